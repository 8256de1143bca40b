# Issue 15, the committed MNIST batch sweep with the polling pool: three rounds, each over a copy of the committed JSON;
# round 1 (chosen before the run) comes back whole, rounds 2 and 3 as their logs.
set -e
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/inst.log 2>&1 || { tail -20 /tmp/inst.log; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
for r in 1 2 3; do
  mkdir -p /tmp/res$r && cp bench/results/sweep_mnist-784-euclidean_batch.json /tmp/res$r/
  python3 -m tqvec.bench.sweep --runs 5 --out /tmp/res$r --update --dataset mnist-784-euclidean \
    --only 'tqvec-ivf 4b residual|tqvec-ivf 4b direct|rabitqlib|turbovec 4b' --batch --threads 16 > $OUT/sweep_round$r.txt 2>&1
  grep "nprobe=4) \|skipped" $OUT/sweep_round$r.txt
done
cp /tmp/res1/sweep_mnist-784-euclidean_batch.json /tmp/res1/sweep_mnist-784-euclidean_batch.md /tmp/res1/*.png $OUT/
lscpu | grep "Model name"
