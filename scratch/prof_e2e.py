import cProfile, io, os, pstats, time
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from tqvec.kv import TurboQuantCache
out = os.environ["OUT"]
cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  num_hidden_layers=4, vocab_size=128256, max_position_embeddings=32768 + 256)
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg).half().eval()
ids = torch.randint(0, cfg.vocab_size, (1, 32768), device="cuda")
torch.backends.cuda.enable_cudnn_sdp(False)
for name, impl, make in (("dyn", "sdpa", lambda: DynamicCache(config=cfg)), ("tq", "tqvec", lambda: TurboQuantCache(cfg))):
    model.set_attn_implementation(impl)
    cache = make()
    with torch.no_grad():
        tok = model(input_ids=ids, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(40):
            tok = model(input_ids=tok, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(32):
            tok = model(input_ids=tok, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 32 * 1000
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(32):
            tok = model(input_ids=tok, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats(60)
    open(f"{out}/prof_{name}.txt", "w").write(f"{name}: {ms:.2f} ms/step unprofiled\n" + s.getvalue())
    print(name, f"{ms:.2f} ms/step", flush=True)
    del cache
    torch.cuda.empty_cache()
