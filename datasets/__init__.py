"""ANN benchmark data sets: ann-benchmarks HDF5 I/O, exact ground truth and a registry of real sets."""
if __name__ == "datasets":  # a checkout's root on sys.path: an installed ``datasets`` package takes this folder's place
    from tqvec._toplevel import defer_to_installed

    defer_to_installed(__name__, __file__)
else:
    from .ground_truth import exact_knn
    from .hdf5 import METRICS, AnnDataset, DatasetError, read_ann_hdf5, write_ann_hdf5
    from .registry import DatasetInfo, build, list_datasets, load

    __all__ = ["METRICS", "AnnDataset", "DatasetError", "DatasetInfo", "build", "exact_knn", "list_datasets", "load",
               "read_ann_hdf5", "write_ann_hdf5"]
