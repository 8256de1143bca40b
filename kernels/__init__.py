"""tqvec's Triton kernels, installed as ``tqvec.kernels``."""
if __name__ == "kernels":  # a checkout's root on sys.path: the installed ``kernels`` package takes this folder's place
    from tqvec._toplevel import defer_to_installed

    defer_to_installed(__name__, __file__)
