"""Keras 3 weights files that point outside themselves, and what loading each one does.

A `.weights.h5` or `.keras` file from elsewhere must not make the loading machine read
its other files: Keras refuses an h5 dataset that is a soft or external link, is stored
in an external file or mapped from another file (virtual), or, from Keras 3.15,
declares far more bytes than it stores (a decompression bomb). `craft` writes ordinary
files of two models (a Dense kernel and an Embedding table, each over the 4 MiB above
which HybridStrategy streams a dataset), then copies of them with their large dataset
made each of those, and a `.keras` file of a `Lambda` layer, which `safe_mode` refuses.
`attempts` loads every file (`load_weights`, `keras.models.load_model`) and reports the
outcome, for tests/test_checkpoint.py to compare with and without a strategy.

```python
import contextlib, keras, crafted_h5
crafted_h5.craft(keras, "/tmp/crafted")
print(crafted_h5.attempts(keras, "/tmp/crafted", contextlib.nullcontext))
```
"""

import functools
import os
import shutil
import zipfile

import numpy as np

MODELS = ("dense", "table")
DEFECTS = ("soft_link", "external_link", "external_storage", "virtual", "bomb")
ENTRIES = ("weights_h5", "keras")
ROWS, WIDTH = 1100, 1024  # float32: 4.3 MiB
# Keras' bomb check applies above 4 GiB declared (and 1000 times what is stored).
_BOMB_SHAPE = (1 << 20, 1025)


def refused(keras_version):
    """The defects a Keras version refuses, which `craft` makes: 3.14.0 refuses external
    storage only, 3.14.1 links and virtual datasets too, 3.15 bombs too. (Keras reads the
    others, from memory or from a file on disk as memory allows: nothing to compare.)"""
    version = tuple(int(part) for part in keras_version.split(".")[:3])
    if version < (3, 14, 1):
        return ("external_storage",)
    return DEFECTS if version >= (3, 15) else DEFECTS[:-1]


def _values(kind):
    shape = (WIDTH, ROWS) if kind == "dense" else (ROWS, WIDTH)
    return (np.arange(ROWS * WIDTH, dtype="float32").reshape(shape) % 997) / 997


def build(keras, kind):
    """The model `kind` ("dense", "table" or "lambda"), its weights as initialized."""
    if kind == "dense":
        layers = [keras.Input((WIDTH,)), keras.layers.Dense(ROWS, use_bias=False, name="big")]
    elif kind == "table":
        layers = [keras.Input((2,), dtype="int32"), keras.layers.Embedding(ROWS, WIDTH,
                                                                           name="big")]
    else:  # its bytecode is saved, for safe_mode to refuse
        layers = [keras.Input((2,)), keras.layers.Lambda(lambda x: x * 2.0, name="big")]
    return keras.Sequential(layers, name=f"{kind}_model")


def _path(directory, kind, defect, entry):
    return os.path.join(directory, f"{kind}-{defect}" + (".keras" if entry == "keras"
                                                          else ".weights.h5"))


def craft(keras, directory):
    """Writes the files `attempts` loads: each model's valid files, one copy of each per
    defect Keras refuses, and the Lambda model's `.keras` file. Call it outside any
    strategy scope."""
    os.makedirs(directory, exist_ok=True)
    for kind in MODELS:
        model = build(keras, kind)
        model.get_layer("big").set_weights([_values(kind)])
        model.save_weights(_path(directory, kind, "valid", "weights_h5"))
        model.save(_path(directory, kind, "valid", "keras"))
        for defect in refused(keras.__version__):
            for entry in ENTRIES:
                _copy_with(defect, _path(directory, kind, "valid", entry),
                           _path(directory, kind, defect, entry), directory)
    build(keras, "lambda").save(os.path.join(directory, "lambda.keras"))


def _copy_with(defect, source, target, directory):
    """`target`: `source` (a weights or .keras file) with its large dataset made `defect`."""
    if not target.endswith(".keras"):
        shutil.copyfile(source, target)
        _make(defect, target, directory)
        return
    weights = target + ".weights.h5"
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(target, "w") as copy:
        for name in archive.namelist():
            if name != "model.weights.h5":
                copy.writestr(name, archive.read(name))
                continue
            with open(weights, "wb") as f:
                f.write(archive.read(name))
            _make(defect, weights, directory)
            copy.write(weights, name)
    os.remove(weights)


def _make(defect, path, directory):
    """Replaces the one large dataset of the h5 file `path` by a `defect` of the same data."""
    import h5py  # pylint: disable=import-outside-toplevel

    with h5py.File(path, "r+") as f:
        large = []
        f.visititems(lambda name, item: large.append(name) if isinstance(
            item, h5py.Dataset) and item.size == ROWS * WIDTH else None)
        (name,) = large
        data = f[name][()]
        shape = "x".join(str(n) for n in data.shape)
        outside = os.path.abspath(os.path.join(directory, f"outside-{shape}.h5"))
        if defect in ("external_link", "virtual") and not os.path.exists(outside):
            with h5py.File(outside, "w") as other:
                other["kernel"] = data
        del f[name]
        if defect == "soft_link":
            f["elsewhere"] = data
            f[name] = h5py.SoftLink("/elsewhere")
        elif defect == "external_link":
            f[name] = h5py.ExternalLink(outside, "/kernel")
        elif defect == "external_storage":
            secret = os.path.abspath(os.path.join(directory, f"secret-{shape}.bin"))
            data.tofile(secret)
            f.create_dataset(name, data.shape, data.dtype,
                             external=[(secret, 0, data.nbytes)])
        elif defect == "virtual":
            layout = h5py.VirtualLayout(data.shape, data.dtype)
            layout[:] = h5py.VirtualSource(outside, "kernel", data.shape)
            f.create_virtual_dataset(name, layout)
        else:  # declared 4 GiB, stored nothing: Keras would allocate it all to read it
            f.create_dataset(name, _BOMB_SHAPE, "float32", chunks=(256, 1025),
                             compression="gzip")


def attempts(keras, directory, scope):
    """{"<model>/<defect>/<entry>": outcome} of loading every file `craft` wrote, models
    made under `scope()`: {"type", "error"} if refused, else how the large variable
    compares with the saved one ("max_error") and the shards of its table, if any."""
    out = {}
    for kind in MODELS:
        with scope():
            model = build(keras, kind)
        for defect in (*refused(keras.__version__), "valid"):
            for entry in ENTRIES:
                path = _path(directory, kind, defect, entry)
                out[f"{kind}/{defect}/{entry}"] = _outcome(kind, functools.partial(
                    _load_weights, model, path) if entry == "weights_h5" else
                    functools.partial(_load_model, keras, path, scope))
    out["lambda/safe_mode/keras"] = _outcome("lambda", functools.partial(
        _load_model, keras, os.path.join(directory, "lambda.keras"), scope))
    return out


def _load_weights(model, path):
    model.load_weights(path)
    return model


def _load_model(keras, path, scope):
    with scope():
        return keras.models.load_model(path)


def _outcome(kind, load):
    try:
        model = load()
    except Exception as error:  # pylint: disable=broad-except
        return {"type": type(error).__name__, "error": str(error)}
    if kind == "lambda":
        return {"error": None}
    variable = model.get_layer("big").weights[0]
    value = getattr(variable, "_value", variable)
    return {"error": None,
            "max_error": float(np.max(np.abs(np.asarray(variable.numpy()) - _values(kind)))),
            "table_shards": getattr(value, "num_shards", None)}
