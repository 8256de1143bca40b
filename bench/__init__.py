"""tqvec's benchmarks, installed as ``tqvec.bench``."""
if __name__ == "bench":  # a checkout's root on sys.path: an installed ``bench`` package takes this folder's place
    from tqvec._toplevel import defer_to_installed

    defer_to_installed(__name__, __file__)
