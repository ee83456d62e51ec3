"""MNIST / Fashion-MNIST loading from the original IDX files.

The files are read from disk only (``<root>/<name>/*-ubyte.gz``); nothing is
downloaded.  :func:`read_idx` is a small, validating reader for the IDX
format so no extra dependency (torchvision) is needed.
"""

from __future__ import annotations

import gzip
import os
import pathlib
import zlib

import numpy as np
import torch

from ._data import ClassificationData, resolve_data_dir

__all__ = ["MNIST_NAMES", "load_mnist", "read_idx"]

#: Dataset names accepted by :func:`load_mnist` (also their folder names).
MNIST_NAMES: tuple[str, ...] = ("fashion-mnist", "mnist")

# IDX type byte -> element type; multi-byte types are stored big-endian.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"
_NUM_CLASSES = 10


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) into a numpy array.

    Parameters
    ----------
    path : str or os.PathLike
        File to read.  Gzip compression is detected from the content (magic
        bytes ``1f 8b``), not from the file name.

    Returns
    -------
    numpy.ndarray
        Array with the shape and element type given by the header, in native
        byte order and writable.

    Raises
    ------
    TypeError
        If ``path`` is not path-like.
    FileNotFoundError
        If the file does not exist.
    ValueError
        If the file is corrupted: bad gzip stream, wrong magic number, unknown
        type code, zero dimensions, or a length that does not match the
        header.  The message names the path.

    Notes
    -----
    Layout: two zero bytes, one type byte (``0x08`` uint8, ``0x09`` int8,
    ``0x0B`` int16, ``0x0C`` int32, ``0x0D`` float32, ``0x0E`` float64), one
    byte with the number of dimensions :math:`k`, then :math:`k` big-endian
    uint32 sizes and :math:`\\prod_i d_i` big-endian elements in row-major
    order.  The file must contain exactly that many bytes.

    References
    ----------
    .. [1] Y. LeCun, C. Cortes, C. J. C. Burges, "The MNIST database of
       handwritten digits", http://yann.lecun.com/exdb/mnist/.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"`path` must be a str or os.PathLike, got {type(path).__name__}")
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file not found: '{path}'")
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise ValueError(f"corrupted gzip stream in IDX file '{path}': {err}") from err
    if len(raw) < 4:
        raise ValueError(f"IDX file '{path}' is too short ({len(raw)} bytes) for a header")
    if raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"IDX file '{path}' has a bad magic number (first two bytes not zero)")
    type_code, ndim = raw[2], raw[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"IDX file '{path}' has unknown type code 0x{type_code:02X}")
    if ndim == 0:
        raise ValueError(f"IDX file '{path}' declares zero dimensions")
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise ValueError(f"IDX file '{path}' is truncated inside its header")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = header_len + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(
            f"IDX file '{path}' has {len(raw)} bytes but its header {dims} implies {expected}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(dims)
    # astype copies, giving a writable native-endian array independent of `raw`.
    return data.astype(dtype.newbyteorder("="))


def _find_file(folder: pathlib.Path, stem: str) -> pathlib.Path:
    """Prefer ``<stem>.gz``; fall back to an already decompressed ``<stem>``."""
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"missing MNIST file: '{folder / (stem + '.gz')}'")


def _load_split(folder: pathlib.Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    image_path = _find_file(folder, f"{prefix}-images-idx3-ubyte")
    label_path = _find_file(folder, f"{prefix}-labels-idx1-ubyte")
    images = read_idx(image_path)
    labels = read_idx(label_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise ValueError(f"'{image_path}' must hold uint8 images [N, H, W], got "
                         f"{images.dtype} {images.shape}")
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise ValueError(f"'{label_path}' must hold uint8 labels [N], got "
                         f"{labels.dtype} {labels.shape}")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"'{image_path}' has {images.shape[0]} images but '{label_path}' "
                         f"has {labels.shape[0]} labels")
    if labels.size and labels.max() >= _NUM_CLASSES:
        raise ValueError(f"'{label_path}' has labels outside 0..{_NUM_CLASSES - 1}")
    return images, labels


def load_mnist(
    *,
    data_dir: str | os.PathLike | None = None,
    name: str = "mnist",
    flatten: bool = True,
    scale: bool = True,
    max_train: int | None = None,
) -> ClassificationData:
    """Load MNIST or Fashion-MNIST from the original IDX files.

    Parameters
    ----------
    data_dir : str, os.PathLike or None, default None
        Datasets root (containing ``<name>/``) or the ``<name>`` folder
        itself; ``None`` reads ``PYROBDL_DATA_DIR``.
    name : {"mnist", "fashion-mnist"}, default "mnist"
        Which dataset; also the folder name below the root.
    flatten : bool, default True
        Return inputs of shape ``[N, 784]``; otherwise ``[N, 1, 28, 28]``
        (a channel axis, ready for convolutional layers).
    scale : bool, default True
        Divide pixels by 255 so they lie in ``[0, 1]``; otherwise keep the
        raw values 0..255 (still float32).
    max_train : int or None, default None
        Keep only the first ``max_train`` training examples (handy for quick
        experiments); larger values than available keep all 60,000.  The test
        set is always complete.

    Returns
    -------
    ClassificationData
        Float32 inputs, int64 labels in ``0..9``, ``num_classes = 10``.

    Raises
    ------
    TypeError
        If an argument has the wrong type.
    ValueError
        If ``name`` is unknown, ``max_train`` is not positive, the data
        directory is missing, or a file is corrupted.
    FileNotFoundError
        If one of the four files is missing (the message names it).

    Notes
    -----
    Expected files in ``<root>/<name>/``: ``train-images-idx3-ubyte.gz``,
    ``train-labels-idx1-ubyte.gz``, ``t10k-images-idx3-ubyte.gz``,
    ``t10k-labels-idx1-ubyte.gz`` (uncompressed copies without ``.gz`` are
    accepted as well).  The ``max_train`` subset is the first examples in
    file order, not a stratified sample.

    References
    ----------
    .. [1] Y. LeCun, L. Bottou, Y. Bengio, P. Haffner, "Gradient-based
       learning applied to document recognition", Proc. IEEE, 1998.
    .. [2] H. Xiao, K. Rasul, R. Vollgraf, "Fashion-MNIST: a Novel Image
       Dataset for Benchmarking Machine Learning Algorithms",
       arXiv:1708.07747, 2017.
    """
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a str, got {type(name).__name__}")
    if name not in MNIST_NAMES:
        raise ValueError(f"unknown `name`={name!r}; valid names: {', '.join(MNIST_NAMES)}")
    for flag_name, flag in (("flatten", flatten), ("scale", scale)):
        if not isinstance(flag, bool):
            raise TypeError(f"`{flag_name}` must be a bool, got {type(flag).__name__}")
    if max_train is not None:
        if isinstance(max_train, bool) or not isinstance(max_train, (int, np.integer)):
            raise TypeError(f"`max_train` must be an int or None, got {type(max_train).__name__}")
        if max_train < 1:
            raise ValueError(f"`max_train` must be >= 1, got {max_train}")
    folder = resolve_data_dir(data_dir, name)

    train_images, train_labels = _load_split(folder, "train")
    test_images, test_labels = _load_split(folder, "t10k")
    if train_images.shape[1:] != test_images.shape[1:]:
        raise ValueError(f"train and test images in '{folder}' have different sizes")
    if max_train is not None:
        # Slice before the float conversion so a small subset stays cheap.
        train_images = train_images[: int(max_train)]
        train_labels = train_labels[: int(max_train)]

    def to_inputs(images: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32)
        if scale:
            x = x.div_(255.0)
        if flatten:
            return x.reshape(x.shape[0], -1)
        return x.unsqueeze(1)

    return ClassificationData(
        name=name,
        x_train=to_inputs(train_images),
        y_train=torch.from_numpy(train_labels.astype(np.int64)),
        x_test=to_inputs(test_images),
        y_test=torch.from_numpy(test_labels.astype(np.int64)),
        num_classes=_NUM_CLASSES,
    )
