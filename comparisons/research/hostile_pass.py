r"""Hostile pass of issue 42: feed pyrobdl bad input of every family and classify each outcome.

    PYTHONPATH=. python comparisons/research/hostile_pass.py [--kills] [--json OUT.json]

Families: API (``fit`` options, synthetic datasets), CSV/NPZ data files, suite files, CLI
arguments, tampered results folders, ``load_posterior`` files, and with ``--kills`` real killed
drivers (``kill -9`` mid-cell, and a ``--workers`` driver killed with SIGKILL/SIGTERM).

Each case expects either a refusal or (controls) success.  Outcome classes:

* ``clear``: refused as expected with one pyrobdl line (CLI: exit 2/3/4 and one ``pyrobdl: error:``
  line; API: ``ValueError``/``TypeError``/``FileNotFoundError``) that names the input (the case's
  needle: an option, a file or a column);
* ``unclear``: refused, but the message does not name the input, or a wrong exit status;
* ``traceback``: an exception other than the documented ones escaped (or a CLI traceback);
* ``silent``: accepted though it should have been refused, or a user's file changed;
* ``late``: refused only when the cell ran (the method's own range check): the cell is recorded
  failed with a message naming the option, exit 1 (documented), not before any work;
* ``ok``: a control case that should succeed did, or a kill lost nothing / left no process.

Prints one line per case and the totals by family and class.  Fits are tiny (MAP, 5 steps).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import pyrobdl
from pyrobdl.cli import main
from pyrobdl.compare.sources import load_dataset
from pyrobdl.datasets import bayesian_linear_regression, gap_regression

SUITE = """
[suite]
name = "hostile"
num_eval_samples = 10
inference_data = false
fit_diagnostics = false

[model]
hidden = [3]

[methods.map]
num_steps = 5

[datasets.gap]
source = "gap"
num_train = 20
num_test = 10
"""

RESULTS: list[dict[str, Any]] = []
DOCUMENTED_API_ERRORS = (ValueError, TypeError, FileNotFoundError)


def record(family: str, name: str, outcome: str, detail: str = "") -> None:
    RESULTS.append({"family": family, "case": name, "outcome": outcome, "detail": detail[:200]})
    print(f"{outcome:9s} {family:14s} {name}: {detail[:150]}", flush=True)


def api_case(family: str, name: str, fn: Callable[[], Any], needle: str | None, expect_ok: bool = False) -> None:
    try:
        fn()
    except DOCUMENTED_API_ERRORS as e:
        msg = str(e)
        if expect_ok:
            return record(family, name, "silent", f"control refused: {type(e).__name__}: {msg}")
        return record(family, name, "clear" if needle is None or needle in msg else "unclear",
                      f"{type(e).__name__}: {msg}")
    except Exception as e:  # noqa: BLE001 - the point: anything undocumented
        return record(family, name, "traceback", f"{type(e).__name__}: {str(e)[:150]}")
    record(family, name, "ok" if expect_ok else "silent", "accepted")


def cli(argv: list[str]) -> tuple[int | None, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except BaseException as e:  # noqa: BLE001
            return None, out.getvalue(), f"Traceback: {type(e).__name__}: {e}"
    return code, out.getvalue(), err.getvalue()


def cli_case(family: str, name: str, argv: list[str], needle: str | None, codes: tuple[int, ...] = (2,),
             expect_ok: bool = False, unchanged: Path | None = None) -> None:
    before = _snapshot(unchanged) if unchanged else None
    code, out, err = cli(argv)
    if before is not None and _snapshot(unchanged) != before:
        return record(family, name, "silent", f"user files changed (exit {code})")
    if code is None or "Traceback" in err:
        return record(family, name, "traceback", err.strip().splitlines()[-1] if err.strip() else "")
    lines = [ln for ln in err.splitlines() if ln.startswith("pyrobdl: error:")]
    if expect_ok:
        return record(family, name, "ok" if code == 0 else "silent", f"exit {code}: {err.strip()[:120]}")
    if code == 1 and needle and needle in err:
        # refused when the cell ran (the method's own check): recorded, exit 1, the message names it
        return record(family, name, "late", f"exit 1: {err.strip().splitlines()[-1][:150]}")
    if code in (0, 1):
        return record(family, name, "silent", f"exit {code}: {(out + err).strip()[-150:]}")
    # one pyrobdl error (its first line; a suite's problems or a folder's files may follow, one a line)
    good = code in codes and len(lines) == 1 and (needle is None or needle in err)
    return record(family, name, "clear" if good else "unclear", f"exit {code}: {lines[0] if lines else err[:150]}")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def write(folder: Path, text: str, name: str = "s.toml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


# ----------------------------------------------------------------------------- families

def api_family(tmp: Path) -> None:
    d = gap_regression(20, 10, seed=0)

    def fit(hidden=(3,), method="map", x=None, y=None, **kw):
        kw.setdefault("num_steps", 3) if "num_steps" in pyrobdl.inference.get_method(method).options else None
        return pyrobdl.fit(pyrobdl.BayesianMLP(1, list(hidden)), d.x_train if x is None else x,
                           d.y_train if y is None else y, method=method, progress=False, **kw)

    api_case("api", "control: fit map", lambda: fit(), None, expect_ok=True)
    for key, value in [("lr", True), ("lr", "0.1"), ("lr", float("nan")), ("lr", -1.0), ("lr", float("inf")),
                       ("num_steps", 0), ("num_steps", 1.5), ("num_steps", True), ("num_steps", 10**13),
                       ("kl_warmup", False), ("batch_size", 0), ("batch_size", True), ("num_particles", 10**12),
                       ("num_particles", 0), ("average_last", float("nan")), ("lr_schedule", "bogus")]:
        api_case("api", f"fit map {key}={value!r}", lambda k=key, v=value: fit(**{k: v}), key)
    for key, value, method in [("init_scale", float("inf"), "mean_field"), ("p", 1.5, "dropout"),
                               ("num_samples", 10**12, "nuts"), ("num_chains", True, "nuts"),
                               ("num_members", 10**12, "ensemble"), ("step_size", -1.0, "hmc")]:
        api_case("api", f"fit {method} {key}={value!r}", lambda k=key, v=value, m=method: fit(method=m, **{k: v}), key)
    api_case("api", "hidden=[10**9]", lambda: fit(hidden=(10**9,)), "hidden")
    api_case("api", "hidden=[10**6]*2", lambda: fit(hidden=(10**6, 10**6)), "hidden")
    api_case("api", "hidden=[0]", lambda: fit(hidden=(0,)), "hidden")
    api_case("api", "hidden=[True]", lambda: fit(hidden=(True,)), "hidden")
    api_case("api", "x with NaN", lambda: fit(x=torch.full_like(d.x_train, float("nan"))), "x")
    api_case("api", "y wrong length", lambda: fit(y=d.y_train[:3]), "y")
    api_case("api", "x 3-D", lambda: fit(x=d.x_train[None]), "x")
    api_case("api", "unknown method", lambda: pyrobdl.fit(pyrobdl.BayesianMLP(1, [3]), d.x_train, d.y_train,
                                                          method="nope", progress=False), "nope")
    api_case("api", "unknown option", lambda: fit(bogus=1), "bogus")
    api_case("api", "seed=-1", lambda: fit(seed=-1), "seed")
    api_case("api", "seed=True", lambda: fit(seed=True), "seed")
    api_case("api", "device=tpu9", lambda: fit(device="tpu9"), "tpu9")
    api_case("api", "threads=0", lambda: fit(threads=0), "threads")
    api_case("api", "gap num_train=10**12", lambda: gap_regression(10**12, 5), "num_train")
    api_case("api", "gap num_train=True", lambda: gap_regression(True, 5), "num_train")
    api_case("api", "blr in_features=10**11", lambda: bayesian_linear_regression(10, 5, in_features=10**11),
             "in_features")
    p = fit()
    api_case("api", "predict num_samples=True", lambda: p.predict(d.x_test, num_samples=True), "num_samples")
    api_case("api", "predict x wrong width", lambda: p.predict(torch.ones(3, 4)), "features")


def data_family(tmp: Path) -> None:
    def load(path: Path, target: Any = "y"):
        opts = {"path": str(path), "target": target, "delimiter": ",", "task": "regression", "test_fraction": 0.25,
                "standardize": True}
        return load_dataset("file", opts, 0, None, path.parent)

    rows = "\n".join(f"{i},{2 * i + 1},{3 * i - 2}" for i in range(1, 13)) + "\n"
    cases: list[tuple[str, bytes, Any, str | None, bool]] = [
        ("control: header y,a,b", b"y,a,b\n" + rows.encode(), "y", None, True),
        ("control: BOM header", b"\xef\xbb\xbfy,a,b\n" + rows.encode(), "y", None, True),
        ("duplicate columns y,x2,y", b"y,x2,y\n" + rows.encode(), "y", "'y'", False),
        ("not UTF-8", b"y,a,\xff\n" + rows.encode(), "y", "UTF-8", False),
        ("ragged row", b"y,a,b\n1,2,3\n4,5\n" + rows.encode(), "y", "line 3", False),
        ("text cell", b"y,a,b\n1,2,3\n4,x,6\n" + rows.encode(), "y", "line 3, column 2", False),
        ("nan cell", b"y,a,b\n1,2,3\n4,nan,6\n" + rows.encode(), "y", "line 3, column 2", False),
        ("1e307 cell", b"y,a,b\n1,2,3\n4,1e307,6\n" + rows.encode(), "y", "line 3, column 2", False),
        ("empty file", b"", "y", "no data rows", False),
        ("header only", b"y,a,b\n", "y", "no data rows", False),
        ("target missing", b"y,a,b\n" + rows.encode(), "z", "'z'", False),
        ("target index 9", b"y,a,b\n" + rows.encode(), 9, "target column 9", False),
        ("target True", b"y,a,b\n" + rows.encode(), True, "target", False),
        ("target 1.0", b"y,a,b\n" + rows.encode(), 1.0, "target", False),
    ]
    for i, (name, blob, target, needle, ok) in enumerate(cases):
        path = tmp / f"d{i}.csv"
        path.write_bytes(blob)
        api_case("csv", name, lambda p=path, t=target: load(p, t), needle if needle else None, expect_ok=ok)
    npz = [("garbage .npz", b"garbage"), ("broken zip .npz", b"PK\x03\x04broken"), ("empty .npz", b"")]
    for i, (name, blob) in enumerate(npz):
        path = tmp / f"g{i}.npz"
        path.write_bytes(blob)
        api_case("csv", name, lambda p=path: load(p), str(path))
    obj = tmp / "obj.npz"
    np.savez(obj, x=np.array([[1.0], [2.0]], dtype=object), y=np.array([1.0, 2.0]))
    api_case("csv", "object array .npz", lambda: load(obj), str(obj))
    npy = tmp / "arr.npz"
    with open(npy, "wb") as fh:
        np.save(fh, np.ones((4, 3)))
    api_case("csv", ".npy named .npz", lambda: load(npy, 0), str(npy))
    bad = tmp / "three.npz"
    np.savez(bad, x=np.ones((4, 2, 2)), y=np.ones(4))
    api_case("csv", "3-D x in .npz", lambda: load(bad), str(bad))
    none = tmp / "none.npz"
    np.savez(none, a=np.ones((4, 2)), b=np.ones(4))
    api_case("csv", ".npz without x/y", lambda: load(none), str(none))


def suite_family(tmp: Path) -> None:
    def case(name: str, text: str | bytes, needle: str | None, expect_ok: bool = False, codes=(2,)) -> None:
        folder = Path(tempfile.mkdtemp(dir=tmp))
        path = folder / "s.toml"
        path.write_bytes(text if isinstance(text, bytes) else textwrap.dedent(text).encode())
        cli_case("suite", name, ["compare", str(path), "--out", str(folder / "o"), "--no-progress"],
                 needle if needle != "$path" else str(path), codes=codes, expect_ok=expect_ok)

    case("control: tiny suite", SUITE, None, expect_ok=True)
    case("100000 nested arrays", "a = " + "[" * 100_000 + "]" * 100_000 + "\n", "$path")
    case("900 nested arrays in description", SUITE.replace('name = "hostile"', 'name = "hostile"\ndescription = '
                                                           + "[" * 900 + "]" * 900), "$path")
    case("not UTF-8", SUITE.replace('"hostile"', '"caf\xe9"').encode("latin-1"), "$path")
    case("binary garbage", os.urandom(256), "$path")
    case("empty file", "", "$path")
    case("unknown key", SUITE.replace("num_steps = 5", "num_stepz = 5"), "num_stepz")
    case("num_steps = -1", SUITE.replace("num_steps = 5", "num_steps = -1"), "num_steps")
    case("num_steps = true", SUITE.replace("num_steps = 5", "num_steps = true"), "num_steps")
    case("lr = true", SUITE.replace("num_steps = 5", "num_steps = 5\nlr = true"), "lr")
    case("lr = nan", SUITE.replace("num_steps = 5", "num_steps = 5\nlr = nan"), "lr")
    case("num_steps = 1e13", SUITE.replace("num_steps = 5", "num_steps = 10000000000000"), "num_steps")
    case("hidden = [1e6, 1e6]", SUITE.replace("hidden = [3]", "hidden = [1000000, 1000000]"), "hidden")
    case("num_eval_samples = 1e13", SUITE.replace("num_eval_samples = 10", "num_eval_samples = 10000000000000"),
         "num_eval_samples")
    case("num_train = 1e12", SUITE.replace("num_train = 20", "num_train = 1000000000000"), "num_train")
    case("num_test = 1e12", SUITE.replace("num_test = 10", "num_test = 1000000000000"), "num_test")
    case("unknown source", SUITE.replace('source = "gap"', 'source = "nope"'), "nope")
    case("missing data file", SUITE.replace('source = "gap"\nnum_train = 20\nnum_test = 10',
                                            'source = "file"\npath = "/nonexistent/d.csv"\ntarget = "y"'),
         "/nonexistent/d.csv")
    case("unknown method", SUITE.replace("[methods.map]", "[methods.nope]"), "nope")
    case("duplicate table", SUITE + "\n[methods.map]\nnum_steps = 6\n", "$path")
    case("chees compile = false (check_model)", SUITE.replace("[methods.map]\nnum_steps = 5",
                                                              "[methods.chees]\nnum_warmup = 3\nnum_samples = 3\n"
                                                              "num_chains = 2\ncompile = false\nmap_num_steps = 2"),
         None, expect_ok=True)


def cli_family(tmp: Path) -> None:
    suite = write(tmp, SUITE)
    user = tmp / "user"
    user.mkdir()
    (user / "suite.toml").write_text("mine")
    (user / "cells.json").write_text("my cells")
    cwd = os.getcwd()
    os.chdir(user)
    try:
        cli_case("cli", "--out ''", ["compare", str(suite), "--out", "", "--no-progress"], "--out", unchanged=user)
        cli_case("cli", "--out . (user folder)", ["compare", str(suite), "--out", ".", "--no-progress"], "--out .",
                 unchanged=user)
        cli_case("cli", "--out '' --dry-run", ["compare", str(suite), "--out", "", "--dry-run"], "--out",
                 unchanged=user)
    finally:
        os.chdir(cwd)
    cli_case("cli", "--out user folder", ["compare", str(suite), "--out", str(user), "--no-progress"], str(user),
             unchanged=user)
    (tmp / "afile").write_text("x")
    cli_case("cli", "--out a file", ["compare", str(suite), "--out", str(tmp / "afile")], str(tmp / "afile"))
    cli_case("cli", "--out inside a file", ["compare", str(suite), "--out", str(tmp / "afile" / "o")], "--out")
    cli_case("cli", "--out 300 chars", ["compare", str(suite), "--out", str(tmp / ("x" * 300))], "300 bytes")
    lockdir = tmp / "lockdir"
    lockdir.mkdir()
    (lockdir / ".pyrobdl.lock").write_text("my notes")
    cli_case("cli", "user .pyrobdl.lock", ["compare", str(suite), "--out", str(lockdir)], ".pyrobdl.lock",
             unchanged=lockdir)
    for name, extra, needle in [("--workers 0", ["--workers", "0"], "--workers"),
                                ("--workers -3", ["--workers", "-3"], "--workers"),
                                ("--threads 0", ["--threads", "0"], "--threads"),
                                ("--only bogus", ["--only", "bogus"], "bogus"),
                                ("--only ''", ["--only", ""], "--only"),
                                ("--only dataset=nope", ["--only", "dataset=nope"], "nope"),
                                ("--device tpu9", ["--device", "tpu9"], "tpu9"),
                                ("--max-retries without ray", ["--max-retries", "1"], "--max-retries"),
                                ("--executor ray (not installed)", ["--executor", "ray"], "ray")]:
        cli_case("cli", name, ["compare", str(suite), "--out", str(tmp / "o_cli"), "--no-progress", *extra], needle)
    cli_case("cli", "missing suite", ["compare", str(tmp / "missing.toml"), "--out", str(tmp / "o2")], "missing.toml")
    cli_case("cli", "suite is a folder", ["compare", str(tmp), "--out", str(tmp / "o3")], str(tmp))
    cli_case("cli", "report of an empty folder", ["report", str(tmp / "user")], None, codes=(3,))
    cli_case("cli", "report of a missing folder", ["report", str(tmp / "nothing")], None, codes=(3,))


def tamper_family(tmp: Path) -> None:
    suite = write(tmp, SUITE)
    base = tmp / "base"
    code, _, err = cli(["compare", str(suite), "--out", str(base), "--no-progress"])
    assert code == 0, err
    cell = next((base / "cells").iterdir()).name

    def case(name: str, damage: Callable[[Path], Any], command: str, needle: str | None, codes=(3,)) -> None:
        out = Path(tempfile.mkdtemp(dir=tmp)) / "o"
        import shutil

        shutil.copytree(base, out)
        needle = needle.replace("$out", str(out)) if needle else None
        damage(out)
        argv = ["report", str(out)] if command == "report" else ["compare", str(suite), "--out", str(out),
                                                                 "--no-progress"]
        cli_case("tamper", f"{command}: {name}", argv, needle, codes=codes)

    def forge_npz(out: Path) -> None:
        from pyrobdl.compare.store import file_sha256

        c = out / "cells" / cell
        np.savez(c / "arrays.npz", history=np.array([1.0, {"a": 1}], dtype=object))
        rec = json.loads((c / "result.json").read_text())
        rec["checksums"]["arrays.npz"] = file_sha256(c / "arrays.npz")
        (c / "result.json").write_text(json.dumps(rec))

    case("user .pyrobdl.lock", lambda o: (o / ".pyrobdl.lock").write_text("notes"), "compare", ".pyrobdl.lock",
         codes=(2,))
    case("symlinked lock", lambda o: ((o / ".pyrobdl.lock").unlink(), (o / ".pyrobdl.lock").symlink_to(suite)),
         "compare", ".pyrobdl.lock", codes=(2,))
    case("garbage cells.json", lambda o: (o / "cells.json").write_text("garbage"), "compare", "cells.json")
    case("garbage cells.json", lambda o: (o / "cells.json").write_text("garbage"), "report", "cells.json")
    case("garbage result.json", lambda o: (o / "cells" / cell / "result.json").write_text("{"), "compare",
         "result.json")
    case("deep result.json", lambda o: (o / "cells" / cell / "result.json").write_text("[" * 100000 + "]" * 100000),
         "report", "result.json")
    case("garbage arrays.npz", lambda o: (o / "cells" / cell / "arrays.npz").write_bytes(b"xx"), "report",
         "arrays.npz")
    case("forged object arrays.npz", forge_npz, "report", "arrays.npz")
    case("deleted arrays.npz", lambda o: (o / "cells" / cell / "arrays.npz").unlink(), "report", "arrays.npz")
    case("record of another cell", lambda o: (o / "cells" / cell).rename(o / "cells" / "gap__map__split-9__seed-0"),
         "report", None)


def posterior_family(tmp: Path) -> None:
    d = gap_regression(20, 10, seed=0)
    post = pyrobdl.fit(pyrobdl.BayesianMLP(1, [3]), d.x_train, d.y_train, method="mean_field", num_steps=3,
                       progress=False)
    base = post.save(tmp / "post")

    def case(name: str, damage: Callable[[Path], Any], needle: str = "$path", expect_ok: bool = False) -> None:
        import shutil

        path = Path(tempfile.mkdtemp(dir=tmp)) / "p"
        shutil.copytree(base, path)
        damage(path)
        api_case("load_posterior", name, lambda: pyrobdl.load_posterior(path), str(path) if needle == "$path" else
                 needle, expect_ok=expect_ok)

    def edit(fn: Callable[[dict], Any]) -> Callable[[Path], Any]:
        def damage(path: Path) -> None:
            meta = json.loads((path / "posterior.json").read_text())
            fn(meta)
            (path / "posterior.json").write_text(json.dumps(meta))
        return damage

    def tensors(fn: Callable[[dict], Any]) -> Callable[[Path], Any]:
        def damage(path: Path) -> None:
            flat = torch.load(path / "tensors.pt", weights_only=True)
            fn(flat)
            torch.save(flat, path / "tensors.pt")
        return damage

    def fill(value: float) -> Callable[[dict], Any]:
        def fn(flat: dict) -> None:
            key = next(k for k in flat if k.startswith("state/") and flat[k].is_floating_point())
            flat[key] = flat[key].clone().fill_(value)
        return fn

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    case("control: untouched", lambda p: None, expect_ok=True)
    case("NaN parameters", tensors(fill(float("nan"))))
    case("inf parameters", tensors(fill(float("inf"))))
    case("garbage JSON", lambda p: (p / "posterior.json").write_text("{x"))
    case("JSON not UTF-8", lambda p: (p / "posterior.json").write_bytes(b"\xff\xfe"))
    case("JSON list", lambda p: (p / "posterior.json").write_text("[]"))
    case("JSON nested 100000", lambda p: (p / "posterior.json").write_text("[" * 100000 + "]" * 100000))
    for key in ("format", "class", "model", "method", "settings", "cost", "diagnostics", "state"):
        case(f"missing {key}", edit(lambda m, k=key: m.pop(k)))
    case("settings a list", edit(lambda m: m.update(settings=[1])))
    case("method a number", edit(lambda m: m.update(method=3)))
    case("unknown method name", edit(lambda m: m.update(method="nope")))
    case("class os.system", edit(lambda m: m.update({"class": {"module": "os", "name": "system"}})))
    case("class pyrobdl.nope", edit(lambda m: m.update({"class": {"module": "pyrobdl.nope", "name": "X"}})))
    case("class module a number", edit(lambda m: m.update({"class": {"module": 1, "name": "X"}})))
    case("model hidden a string", edit(lambda m: m["model"].update(hidden="many")))
    case("model activation bogus", edit(lambda m: m["model"].update(activation="bogus")))
    case("cost unknown field", edit(lambda m: m.update(cost={"bogus": 1})))
    case("certification a list", edit(lambda m: m.update(certification=[1])))
    case("format_version 99", edit(lambda m: m.update(format_version=99)))
    case("garbage tensors.pt", lambda p: (p / "tensors.pt").write_bytes(b"garbage"))
    case("tensors.pt a list", lambda p: torch.save([1, 2], p / "tensors.pt"))
    case("tensors.pt without history", tensors(lambda f: f.pop("history")))
    case("tensors.pt wrong shape", tensors(lambda f: f.update({k: torch.ones(7) for k in f if k.startswith("state/")})))
    case("pickled object in tensors.pt", lambda p: (p / "tensors.pt").write_bytes(pickle.dumps({"history": Evil()})))
    api_case("load_posterior", "missing folder", lambda: pyrobdl.load_posterior(tmp / "nothing"), "nothing")


def kill_family(tmp: Path) -> None:
    """Real killed drivers: --workers processes must end within 10 s; a kill -9 mid-cell loses only that cell."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    for sig in (signal.SIGKILL, signal.SIGTERM):
        folder = Path(tempfile.mkdtemp(dir=tmp))
        suite = write(folder, SUITE.replace("num_steps = 5", "num_steps = 100000000")
                      .replace("num_test = 10", "num_test = 10\nsplits = [0, 1]"))
        driver = subprocess.Popen([sys.executable, "-m", "pyrobdl.cli", "compare", str(suite), "--out",
                                   str(folder / "o"), "--no-progress", "--workers", "2", "--threads", "1"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        workers: list[int] = []
        deadline = time.time() + 400
        while time.time() < deadline and len(workers) < 2 and driver.poll() is None:
            workers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(int(p.name)) ==
                       driver.pid and _comm(int(p.name)) == "pyrobdl-worker"]
            time.sleep(0.3)
        if len(workers) < 2:
            driver.kill()
            record("kills", f"workers, driver {sig.name}", "unclear", "workers did not start")
            continue
        time.sleep(1.0)
        t0 = time.time()
        os.kill(driver.pid, sig)
        while time.time() - t0 < 10 and any(_alive(w) for w in workers):
            time.sleep(0.1)
        left = [w for w in workers if _alive(w)]
        for w in left:
            os.kill(w, signal.SIGKILL)
        driver.wait()
        record("kills", f"workers, driver {sig.name}", "silent" if left else "ok",
               f"{len(left)} worker(s) alive after 10 s" if left else f"workers gone {time.time() - t0:.1f} s")


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def main_pass() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", action="store_true", help="also kill real drivers (minutes on a loaded machine)")
    parser.add_argument("--json", help="write every case's outcome here")
    args = parser.parse_args()
    import warnings

    warnings.simplefilter("ignore")
    families = [api_family, data_family, suite_family, cli_family, tamper_family, posterior_family]
    if args.kills:
        families.append(kill_family)
    with tempfile.TemporaryDirectory() as tmp:
        for fam in families:
            fam(Path(tempfile.mkdtemp(dir=tmp)))
    classes = ["clear", "ok", "late", "unclear", "silent", "traceback"]
    print(f"\n{'family':16s}" + "".join(f"{c:>10s}" for c in classes) + f"{'total':>8s}")
    for fam in dict.fromkeys(r["family"] for r in RESULTS):
        rows = [r for r in RESULTS if r["family"] == fam]
        print(f"{fam:16s}" + "".join(f"{sum(r['outcome'] == c for r in rows):10d}" for c in classes) + f"{len(rows):8d}")
    print(f"{'all':16s}" + "".join(f"{sum(r['outcome'] == c for r in RESULTS):10d}" for c in classes)
          + f"{len(RESULTS):8d}")
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main_pass()
