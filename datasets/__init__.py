"""ANN benchmark data sets: ann-benchmarks HDF5 I/O, exact ground truth and a registry of real sets."""
from .ground_truth import exact_knn
from .hdf5 import METRICS, AnnDataset, DatasetError, read_ann_hdf5, write_ann_hdf5
from .registry import DatasetInfo, build, list_datasets, load

__all__ = ["METRICS", "AnnDataset", "DatasetError", "DatasetInfo", "build", "exact_knn", "list_datasets", "load",
           "read_ann_hdf5", "write_ann_hdf5"]
