"""Datasets -> host arrays -> batches: MNIST, Fashion-MNIST, smallNORB, affNIST,
CIFAR-10, SVHN and your own images (a folder of class subfolders, a .npz, a
TFDS dataset).

Loaders return uint8 ``[N, H, W, C]`` images and int32 labels in host memory
(``Dataset`` of ``Split``); augmentation and preprocessing are pure jit-able
JAX functions of a PRNG key and a batch.
"""

from capsjax.data.affnist import affine_mnist
from capsjax.data.affnist import affnist_files
from capsjax.data.affnist import load_affnist
from capsjax.data.augment import center_crop
from capsjax.data.augment import dataset_on_canvas
from capsjax.data.augment import efficient_capsnet_augment
from capsjax.data.augment import on_canvas
from capsjax.data.augment import place_on_canvas
from capsjax.data.augment import random_shift
from capsjax.data.augment import shift
from capsjax.data.augment import to_float
from capsjax.data.cifar10 import cifar10_eval_preprocess
from capsjax.data.cifar10 import cifar10_train_preprocess
from capsjax.data.cifar10 import read_cifar_binary
from capsjax.data.cifar10 import read_cifar_pickle
from capsjax.data.cifar10 import write_cifar_binary
from capsjax.data.cifar10 import write_cifar_pickle
from capsjax.data.idx import DataError
from capsjax.data.idx import Dataset
from capsjax.data.idx import Split
from capsjax.data.idx import read_idx
from capsjax.data.images import ImageOptions
from capsjax.data.images import OwnImages
from capsjax.data.images import read_cached
from capsjax.data.images import read_images
from capsjax.data.images import stratified_split
from capsjax.data.multimnist import load_multimnist
from capsjax.data.multimnist import multimnist_batch
from capsjax.data.multimnist import multimnist_pairs
from capsjax.data.multimnist import multimnist_test_set
from capsjax.data.multimnist import pack_pairs
from capsjax.data.multimnist import unpack_pairs
from capsjax.data.registry import load_dataset
from capsjax.data.smallnorb import combine_crop_activations
from capsjax.data.smallnorb import read_norb_matrix
from capsjax.data.smallnorb import smallnorb_distort
from capsjax.data.smallnorb import smallnorb_eval_preprocess
from capsjax.data.smallnorb import smallnorb_multicrop
from capsjax.data.smallnorb import smallnorb_train_draws
from capsjax.data.smallnorb import smallnorb_train_preprocess
from capsjax.data.smallnorb import write_norb_matrix
from capsjax.data.svhn import read_svhn_mat
from capsjax.data.svhn import write_svhn_mat
from capsjax.data.two_digit_transfer import PAIR_LAYOUTS
from capsjax.data.two_digit_transfer import blank_fields
from capsjax.data.two_digit_transfer import digit_pairs

__all__ = (
    'PAIR_LAYOUTS',
    'DataError',
    'Dataset',
    'ImageOptions',
    'OwnImages',
    'Split',
    'affine_mnist',
    'affnist_files',
    'blank_fields',
    'center_crop',
    'cifar10_eval_preprocess',
    'cifar10_train_preprocess',
    'combine_crop_activations',
    'dataset_on_canvas',
    'efficient_capsnet_augment',
    'digit_pairs',
    'load_affnist',
    'load_dataset',
    'load_multimnist',
    'multimnist_batch',
    'multimnist_pairs',
    'multimnist_test_set',
    'on_canvas',
    'pack_pairs',
    'place_on_canvas',
    'random_shift',
    'read_cifar_binary',
    'read_cifar_pickle',
    'read_cached',
    'read_idx',
    'read_images',
    'read_norb_matrix',
    'read_svhn_mat',
    'shift',
    'smallnorb_distort',
    'smallnorb_eval_preprocess',
    'smallnorb_multicrop',
    'smallnorb_train_draws',
    'smallnorb_train_preprocess',
    'stratified_split',
    'to_float',
    'unpack_pairs',
    'write_cifar_binary',
    'write_cifar_pickle',
    'write_norb_matrix',
    'write_svhn_mat',
)
