"""CPU seconds of ``pyrobdl.compare.compute.netcdf_bytes`` against its earlier read-back (re-opening the
bytes as an xarray tree), over every ``inference_data.nc`` of a results folder, alternating rounds.

    python comparisons/benchmarks/netcdf_readback.py RESULTS_FOLDER [--rounds 3]
"""
import argparse
import glob
import io
import statistics
import time

import arviz as az
import xarray as xr

from pyrobdl.compare import compute


def earlier(idata):
    """netcdf_bytes as it was before ce2f506: the same encoding, read back with xr.open_datatree."""
    tree = idata.to_datatree()
    enc = {n.path: {k: {"zlib": True, "complevel": 1, "shuffle": True} for k, v in n.dataset.variables.items()
                    if v.dtype.kind in "biuf"} for n in tree.subtree if n.has_data}
    buf = io.BytesIO()
    tree.to_netcdf(buf, engine="h5netcdf", encoding=enc)
    blob = buf.getvalue()
    with xr.open_datatree(io.BytesIO(blob), engine="h5netcdf") as back:
        assert not {n.path for n in tree.subtree if n.has_data} - {n.path for n in back.subtree if n.has_data}
    return blob


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    ids = []
    for path in sorted(glob.glob(f"{a.folder}/cells/*/inference_data.nc")):
        idata = az.from_netcdf(path)
        for g in idata.groups():
            getattr(idata, g).load()
        ids.append(idata)
    fns = {"earlier": earlier, "now": compute.netcdf_bytes}
    res = {k: [] for k in fns}
    for r in range(a.rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            c = time.process_time()
            for idata in ids:
                fns[name](idata)
            res[name].append(time.process_time() - c)
    print(f"{len(ids)} files; CPU s per pass over them:", {k: [round(x, 2) for x in v] for k, v in res.items()},
          "medians:", {k: round(statistics.median(v), 2) for k, v in res.items()})


if __name__ == "__main__":
    main()
