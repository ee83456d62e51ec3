"""The comparison suite loses nothing: cell identity, the folder lock, checksums, write failures,
and a report that reads only verified cells of its suite (issue 15).

Fits are tiny (MAP, a few steps on 20 points): what is tested is the bookkeeping.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pyrobdl.cli import EXIT_CODES, main
from pyrobdl.compare import ConfigError, ResultsError, expand, load_suite, parse_suite, read_result, run_suite
from pyrobdl.compare import store
from pyrobdl.compare.config import label_problem, tomllib
from pyrobdl.compare.grid import cell_id, parse_only
from pyrobdl.compare.lock import LOCK_FILE, FolderLockedError, OutFolderError, RunLock, check_out_folder
from pyrobdl.compare.sources import load_dataset
from pyrobdl.compare.store import RESULT_FILE, WriteError, clean_tmp, config_hash
from pyrobdl.report import build_report

SUITE = """
[suite]
name = "integrity"
num_eval_samples = 10
inference_data = false
fit_diagnostics = false

[model]
hidden = [3]
likelihood = { kind = "gaussian", precision = 50.0 }

[methods.map]
num_steps = 5

[datasets.gap]
source = "gap"
num_train = 20
num_test = 10
"""

REF_SUITE = SUITE.replace("[suite]", '[suite]\nreference = "map"') + "\n[methods.mean_field]\nnum_steps = 5\n"


def write_suite(tmp_path: Path, text: str = SUITE, name: str = "suite.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def run(path: Path, out: Path, **kwargs):
    return run_suite(load_suite(path), out, progress=False, **kwargs)


# ----------------------------------------------------------------------------- cell identity

LABEL_ALPHABET = "aAbB01_-_-\n ._/"


def test_adversarial_label_pairs_never_share_a_folder():
    """Random labels rich in separators, case and odd characters: every accepted pair of cells has
    its own folder, also on a case-insensitive disk, and the id splits back into its parts."""
    rng = random.Random(15)
    labels = {"".join(rng.choice(LABEL_ALPHABET) for _ in range(rng.randint(1, 7))) for _ in range(3000)}
    labels |= {"a__b", "a", "b__map", "map", "a_", "_a", "a\n", "a-_b", "A", "a" * 65, "a" * 64, "x-y_z"}
    valid = sorted(label for label in labels if label_problem(label) is None)
    assert "a" in valid and "x-y_z" in valid and "a" * 64 in valid
    for bad in ("a__b", "b__map", "a_", "_a", "a\n", "a-_b", "a" * 65, "a b", "a/b", "a.b"):
        assert bad not in valid and "invalid label" in label_problem(bad)
        with pytest.raises(ValueError, match="invalid label"):
            cell_id(bad, "map", 0, 0)
    assert len(valid) > 100
    # pairs built to collide: every way of cutting one string at a '__' into (dataset, method)
    # gives the same "<dataset>__<method>"; at most one such cut may be valid
    for _ in range(2000):
        text = "__".join("".join(rng.choice("aB1_-") for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(2, 4)))
        cuts = [i for i in range(len(text) - 1) if text[i:i + 2] == "__"]
        accepted = [(text[:i], text[i + 2:]) for i in cuts
                    if label_problem(text[:i]) is None and label_problem(text[i + 2:]) is None]
        assert len(accepted) <= 1, (text, accepted)
    ids: dict[str, tuple] = {}
    for d in valid[:120]:
        for m in valid[:120]:
            for split, seed in ((0, 0), (1, 0), (0, 10)):
                cid = cell_id(d, m, split, seed)
                key = cid.casefold()
                # identical folder names (or case-folded ones) only for identical identities up to case
                assert ids.setdefault(key, (d.casefold(), m.casefold(), split, seed)) == (d.casefold(), m.casefold(), split, seed)
                parts = cid.split("__")
                assert parts == [d, m, f"split-{split}", f"seed-{seed}"]
    # the collision of the probe: dataset a__b x map against dataset a x b__map
    with pytest.raises(ConfigError, match="invalid label 'a__b'"):
        parse_suite(tomllib.loads(SUITE.replace("[datasets.gap]", '[datasets."a__b"]')), "/x/s.toml")
    with pytest.raises(ConfigError, match="invalid label 'b__map'"):
        parse_suite(tomllib.loads(SUITE.replace("[methods.map]", '[methods."b__map"]\nmethod = "map"')), "/x/s.toml")
    with pytest.raises(ConfigError, match="invalid label 'gap\\\\n'"):
        parse_suite(tomllib.loads(SUITE.replace("[datasets.gap]", '[datasets."gap\\n"]')), "/x/s.toml")


def test_labels_differing_only_in_case_are_refused():
    text = SUITE + '\n[methods.MAP]\nmethod = "map"\n'
    with pytest.raises(ConfigError, match=r"methods\.MAP: differs from methods\.map only in letter case"):
        parse_suite(tomllib.loads(text), "/x/s.toml")


def test_a_record_in_the_wrong_folder_is_corrupt(tmp_path):
    path = write_suite(tmp_path, SUITE.replace("[datasets.gap]", "[datasets.gap]\nsplits = [0, 1]"))
    out = tmp_path / "out"
    assert run(path, out).success
    cells = out / "cells"
    a, b = cells / "gap__map__split-0__seed-0", cells / "gap__map__split-1__seed-0"
    shutil.copyfile(a / RESULT_FILE, b / RESULT_FILE)  # a copied record claims another cell's folder
    with pytest.raises(ResultsError, match="it is the record of cell 'gap__map__split-0__seed-0'"):
        run(path, out)


# ----------------------------------------------------------------------------- one writer

HOLDER = """
import sys, time
from pathlib import Path
from pyrobdl.compare.lock import RunLock
with RunLock(Path(sys.argv[1]), "r0123456789ab"):
    print("locked", flush=True)
    time.sleep(120)
"""


def _hold_lock(tmp_path: Path, out: Path) -> subprocess.Popen:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, str(script), str(out)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_run_on_a_locked_folder_exits_2_and_a_killed_holder_leaves_no_stale_lock(tmp_path, capsys):
    """A real process holds the lock: compare exits 2 at once naming the folder and the holder's pid;
    after kill -9 of the holder the same command runs with no manual step."""
    path = write_suite(tmp_path)
    out = tmp_path / "out"
    check_out_folder(out)
    holder = _hold_lock(tmp_path, out)
    try:
        t0 = time.perf_counter()
        assert main(["compare", str(path), "--out", str(out), "--no-progress"]) == EXIT_CODES["usage"]
        assert time.perf_counter() - t0 < 30
        err = capsys.readouterr().err
        assert f"results folder {out} is in use by another pyrobdl run (pid {holder.pid}" in err
        assert not list((out / "cells").iterdir())  # nothing ran
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    assert (out / LOCK_FILE).exists()  # the file stays; nobody holds it
    assert main(["compare", str(path), "--out", str(out), "--no-progress"]) == 0
    assert "1 cell(s) ran ok" in capsys.readouterr().out


def test_lock_is_exclusive_within_one_process_too(tmp_path):
    with RunLock(tmp_path, "r000000000001"):
        with pytest.raises(FolderLockedError, match=f"pid {os.getpid()}"):
            with RunLock(tmp_path, "r000000000002"):
                pass
    with RunLock(tmp_path, "r000000000003"):  # released on exit
        pass


def test_temporary_files_of_live_runs_and_of_users_are_left_alone(tmp_path):
    """Only pyrobdl's own temporary names whose process is gone are deleted at start; a live
    process's in-flight file and a user's file that merely looks similar are kept."""
    path = write_suite(tmp_path)
    out = tmp_path / "out"
    assert run(path, out).success
    folder = out / "cells" / "gap__map__split-0__seed-0"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = folder / f".arrays.npz.tmp-r0123456789ab-{sleeper.pid}-abcdef01"
        dead = folder / ".arrays.npz.tmp-r0123456789ab-999999999-abcdef01"
        users = [folder / ".x.tmp-y", folder / ".notes.tmp-1234", tmp_path / "out" / "cells" / ".y.tmp-z"]
        for p in (live, dead, *users):
            p.write_text("x")
        assert clean_tmp(out / "cells") == 1
        assert live.exists() and not dead.exists() and all(p.exists() for p in users)
        assert clean_tmp(out / "cells", run_id="r0123456789ab") == 1  # a run cleans its own, all of them
        assert not live.exists() and all(p.exists() for p in users)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_temporary_files_are_named_by_their_run(tmp_path, monkeypatch):
    names = []
    real = os.replace

    def spy(src, dst):
        names.append(Path(src).name)
        return real(src, dst)

    monkeypatch.setattr(store.os, "replace", spy)
    assert run(write_suite(tmp_path), tmp_path / "out").success
    run_ids = {store._TMP.match(n).group(1) for n in names}
    assert len(run_ids) == 1 and all(store._TMP.match(n) for n in names), names


# ----------------------------------------------------------------------------- checksums

def test_every_artifact_has_its_checksum_and_damage_means_redo(tmp_path, capsys):
    """Truncated netCDF, garbage npz: compare redoes the cell; report exits 3 naming the file."""
    path = write_suite(tmp_path, SUITE.replace("inference_data = false", "inference_data = true"))
    out = tmp_path / "out"
    assert run(path, out).success
    folder = out / "cells" / "gap__map__split-0__seed-0"
    rec = read_result(folder / RESULT_FILE)
    assert set(rec["checksums"]) == {"arrays.npz", "inference_data.nc"} == set(rec["artifacts"].values())
    for name, sha in rec["checksums"].items():
        assert store.file_sha256(folder / name) == sha
    from pyrobdl.diagnostics.arviz_adapter import az

    assert "posterior" in az.from_netcdf(str(folder / "inference_data.nc")).groups()
    nc = folder / "inference_data.nc"
    nc.write_bytes(nc.read_bytes()[: nc.stat().st_size // 2])  # truncated
    assert main(["report", str(out)]) == EXIT_CODES["results"]
    err = capsys.readouterr().err
    assert f"{nc} does not match its checksum" in err
    summary = run(path, out)
    assert summary.ok == ("gap__map__split-0__seed-0",)
    assert store.file_sha256(nc) == read_result(folder / RESULT_FILE)["checksums"]["inference_data.nc"]
    (folder / "arrays.npz").write_bytes(b"garbage")
    assert main(["report", str(out)]) == EXIT_CODES["results"]
    assert "arrays.npz does not match its checksum" in capsys.readouterr().err
    (folder / "arrays.npz").unlink()
    assert run(path, out).ok == ("gap__map__split-0__seed-0",)
    assert main(["report", str(out)]) == 0


def _ref_suite(tmp_path):
    path = write_suite(tmp_path, REF_SUITE)
    out = tmp_path / "out"
    assert run(path, out).success
    cells = out / "cells"
    return path, out, cells / "gap__map__split-0__seed-0", cells / "gap__mean_field__split-0__seed-0"


def test_damaged_or_deleted_reference_draws_are_refitted(tmp_path):
    path, out, ref, dep = _ref_suite(tmp_path)
    draws = ref / "reference_draws.pt"
    sha = read_result(ref / RESULT_FILE)["checksums"]["reference_draws.pt"]
    assert read_result(dep / RESULT_FILE)["reference"]["draws_sha256"] == sha
    draws.write_bytes(draws.read_bytes()[:100])  # truncated: torch's zip error would not name the file
    summary = run(path, out)
    assert "gap__map__split-0__seed-0" in summary.ok
    assert store.file_sha256(draws) == read_result(ref / RESULT_FILE)["checksums"]["reference_draws.pt"]
    dep_rec = read_result(dep / RESULT_FILE)
    assert dep_rec["status"] == "ok" and dep_rec["reference"]["used"]
    assert dep_rec["reference"]["draws_sha256"] == store.file_sha256(draws)
    draws.unlink()
    assert "gap__map__split-0__seed-0" in run(path, out).ok
    assert run(path, out).ok == ()  # and then everything is done


def test_a_refitted_reference_makes_its_dependents_stale(tmp_path):
    """Other draws under the reference's name (a refit with another result): the dependent cell was
    scored against the old draws and is redone; a rerun after that does nothing."""
    path, out, ref, dep = _ref_suite(tmp_path)
    rec = read_result(ref / RESULT_FILE)
    import torch

    draws = torch.load(ref / "reference_draws.pt", weights_only=True)
    draws = {k: v + 1.0 for k, v in draws.items()}
    import io

    buf = io.BytesIO()
    torch.save(draws, buf)
    rec["checksums"]["reference_draws.pt"] = store.atomic_write_bytes(ref / "reference_draws.pt", buf.getvalue())
    store.atomic_write_json(ref / RESULT_FILE, rec)
    summary = run(path, out)
    assert summary.ok == ("gap__mean_field__split-0__seed-0",) and summary.skipped == ("gap__map__split-0__seed-0",)
    assert read_result(dep / RESULT_FILE)["reference"]["draws_sha256"] == rec["checksums"]["reference_draws.pt"]
    assert run(path, out).ok == ()


def test_reference_draws_damaged_between_planning_and_use_fail_the_dependent_naming_the_file(tmp_path, monkeypatch):
    path, out, ref, dep = _ref_suite(tmp_path)
    (dep / RESULT_FILE).unlink()
    from pyrobdl.compare import runner

    real = runner._state

    def damage_after_planning(c, root):  # the reference looks fine when planned, then is damaged
        state = real(c, root)
        (ref / "reference_draws.pt").write_bytes(b"PK\x03\x04 not a zip")
        return state

    monkeypatch.setattr(runner, "_state", damage_after_planning)
    summary = run(path, out)
    assert summary.failed == ("gap__mean_field__split-0__seed-0",)
    assert f"reference draws {ref / 'reference_draws.pt'} do not match the checksum" in summary.errors[summary.failed[0]]


# ----------------------------------------------------------------------------- write failures

def _fail_on(monkeypatch, name: str, code: int = errno.ENOSPC):
    real = os.replace

    def replace(src, dst):
        if Path(dst).name == name:
            raise OSError(code, os.strerror(code))
        return real(src, dst)

    monkeypatch.setattr(store.os, "replace", replace)


@pytest.mark.parametrize("name,code", [("arrays.npz", errno.ENOSPC), ("result.json", errno.EIO),
                                       ("inference_data.nc", errno.EACCES)])
def test_write_failure_stops_the_run_with_exit_4_naming_the_file(tmp_path, monkeypatch, capsys, name, code):
    path = write_suite(tmp_path, SUITE.replace("inference_data = false", "inference_data = true"))
    out = tmp_path / "out"
    _fail_on(monkeypatch, name, code)
    assert main(["compare", str(path), "--out", str(out), "--no-progress"]) == EXIT_CODES["write_failed"] == 4
    err = capsys.readouterr().err
    first = out / "cells" / "gap__map__split-0__seed-0"
    assert f"cannot write {first / name}: [Errno {code}] {os.strerror(code)}" in err
    assert not list(out.glob(f"cells/*/{RESULT_FILE}"))  # nothing counted done
    assert not list(out.glob("cells/*/.*.tmp-*"))
    monkeypatch.undo()
    assert main(["compare", str(path), "--out", str(out), "--no-progress"]) == 0
    assert "1 cell(s) ran ok, 0 failed, 0 already done" in capsys.readouterr().out


def test_a_failed_netcdf_serialisation_fails_the_cell(tmp_path, monkeypatch):
    from pyrobdl.compare import compute

    def broken(idata):
        raise ValueError("h5netcdf: cannot encode")

    monkeypatch.setattr(compute, "netcdf_bytes", broken)
    out = tmp_path / "out"
    summary = run(write_suite(tmp_path, SUITE.replace("inference_data = false", "inference_data = true")), out)
    assert summary.failed == ("gap__map__split-0__seed-0",)
    rec = read_result(out / "cells" / summary.failed[0] / RESULT_FILE)
    assert rec["error"]["stage"] == "inference data" and "cannot encode" in rec["error"]["message"]


def test_the_netcdf_read_back_finds_a_lost_or_reshaped_variable():
    """``netcdf_bytes`` reads its bytes back before they are stored: every group and variable, with
    its shape, must be in the file (checked here on a real file against altered expectations)."""
    import arviz as az
    import numpy as np

    from pyrobdl.compare import compute

    idata = az.from_dict(posterior={"w": np.zeros((2, 5, 3))}, log_likelihood={"y": np.zeros((2, 5, 4))},
                         sample_stats={"diverging": np.zeros((2, 5), bool)})
    blob = compute.netcdf_bytes(idata)
    wanted = {"posterior": {"w": (2, 5, 3), "chain": (2,), "draw": (5,)}, "log_likelihood": {"y": (2, 5, 4)}}
    assert compute._netcdf_differences(blob, wanted) == []
    assert compute._netcdf_differences(blob, {**wanted, "posterior_predictive": {"y": (2, 5, 4)}}) == [
        "group 'posterior_predictive'"]
    assert compute._netcdf_differences(blob, {"posterior": {"w": (2, 5, 4), "v": (1,)}}) == [
        "posterior/w [2, 5, 4]", "posterior/v [1]"]


def _small_tmpfs(tmp_path: Path) -> Path:
    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode()[:200]}")
    return mnt


@pytest.mark.slow
def test_a_really_full_disk_exits_4_not_a_signal(tmp_path):
    """The probe's case: a small tmpfs fills up during the netCDF write (was: exit 139).  A
    stochastic posterior (mean field), so that 2,000 predictive draws at 200 test points are far
    more than the 400 kB (a MAP fit now stores one draw, and its results fit)."""
    mnt = _small_tmpfs(tmp_path)
    try:
        path = write_suite(tmp_path, SUITE.replace("inference_data = false", "inference_data = true")
                           .replace("[methods.map]", "[methods.mean_field]")
                           .replace("num_eval_samples = 10", "num_eval_samples = 2000")
                           .replace("num_test = 10", "num_test = 200"))
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        done = subprocess.run([sys.executable, "-m", "pyrobdl.cli", "compare", str(path), "--out", str(mnt / "out"),
                               "--no-progress"], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 4, (done.returncode, done.stderr[-2000:])
        assert "No space left on device" in done.stderr and "cannot write" in done.stderr
        assert not list((mnt / "out").glob(f"cells/*/{RESULT_FILE}"))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.parametrize("kind", ["file", "inside_file"])
def test_bad_out_fails_before_work_with_exit_2(tmp_path, capsys, kind):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out = blocker if kind == "file" else blocker / "sub"
    assert main(["compare", str(write_suite(tmp_path)), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}:" in err and "Traceback" not in err
    assert blocker.read_text() == "x"


def test_unwritable_out_fails_before_work(tmp_path, monkeypatch):
    real = os.open

    def deny(path, flags, *args):
        if ".write-probe-" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(path, flags, *args)

    from pyrobdl.compare import lock

    monkeypatch.setattr(lock.os, "open", deny)
    with pytest.raises(OutFolderError, match="cannot write in it: Permission denied"):
        run(write_suite(tmp_path), tmp_path / "out")


# ----------------------------------------------------------------------------- report

def test_report_reads_only_the_suites_cells_and_refuses_edited_records(tmp_path, capsys):
    path = write_suite(tmp_path)
    out = tmp_path / "out"
    assert run(path, out).success
    cells = out / "cells"
    # a cell folder copied in from another results folder (another suite): skipped, and said so
    other = write_suite(tmp_path, SUITE.replace("num_steps = 5", "num_steps = 6")
                        .replace("[datasets.gap]", "[datasets.gap2]\nsource = \"gap\"\n[datasets.gapx]"), "other.toml")
    other_out = tmp_path / "other"
    assert run(other, other_out, only={"dataset": {"gap2"}}).success
    shutil.copytree(other_out / "cells" / "gap2__map__split-0__seed-0", cells / "gap2__map__split-0__seed-0")
    files = build_report(out)
    assert files.cells == 1
    md = files.markdown.read_text()
    assert "Skipped 1 cell folder(s): gap2__map__split-0__seed-0: not a cell of the suite stored with the results" in md
    # an edited config keeping the original hash
    rec_path = cells / "gap__map__split-0__seed-0" / RESULT_FILE
    rec = json.loads(rec_path.read_text())
    rec["config"]["method"]["options"]["num_steps"] = 5000
    rec_path.write_text(json.dumps(rec))
    assert main(["report", str(out)]) == 3
    assert "its config does not hash to its config_hash" in capsys.readouterr().err


@pytest.mark.parametrize("change", [
    lambda r: {"a": r, "deep": json.loads("[" * 5000 + "]" * 5000)},
    lambda r: {**r, "split": "0"},
    lambda r: {**r, "status": ["ok"]},
    lambda r: {**r, "metrics": {"rmse": {"nested": 1}}},
    lambda r: {**r, "artifacts": {"arrays": "../../etc/passwd"}},
    lambda r: {**r, "config_hash": 7},
    lambda r: {**r, "dataset": "gap\n<script>"},
    lambda r: {**r, "method": "mean_field"},
    lambda r: {**r, "wall_time_s": "x"},
    lambda r: {**r, "cost": {**r["cost"], "wall_time_s": [1]}},
    lambda r: {**r, "published": -1e308},
    lambda r: {**r, "warnings": [{"a": 1}]},
])
def test_hostile_records_are_clear_errors(tmp_path, capsys, change):
    path = write_suite(tmp_path)
    out = tmp_path / "out"
    assert run(path, out).success
    rec_path = out / "cells" / "gap__map__split-0__seed-0" / RESULT_FILE
    try:
        rec_path.write_text(json.dumps(change(json.loads(rec_path.read_text()))))
    except RecursionError:
        rec_path.write_text('{"a": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(ResultsError, match="corrupt result file"):
        store.check_identity(read_result(rec_path), rec_path)
    assert main(["report", str(out)]) == 3
    assert main(["compare", str(path), "--out", str(out), "--no-progress"]) == 3
    err = capsys.readouterr().err
    assert str(rec_path) in err and "Traceback" not in err


def test_manifest_lists_the_whole_grid_even_with_only(tmp_path):
    path = write_suite(tmp_path, SUITE.replace("[datasets.gap]", "[datasets.gap]\nsplits = [0, 1]"))
    out = tmp_path / "out"
    run(path, out, only={"split": {"1"}})
    manifest = store.read_manifest(out)
    assert manifest == {c.id: c.config_hash for c in expand(load_suite(path))}
    assert all(config_hash(c.spec) == c.config_hash for c in expand(load_suite(path)))


# ----------------------------------------------------------------------------- input edge cases



def _file(tmp_path: Path, text: str, name: str = "d.csv") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def _load(path: Path, target, task: str = "regression"):
    opts = {"path": str(path), "target": target, "delimiter": ",", "task": task, "test_fraction": 0.25,
            "standardize": True}
    return load_dataset("file", opts, 0, None, path.parent)


def test_csv_without_header_keeps_its_first_row(tmp_path):
    rows = [[i, 2 * i, 3.5 * i] for i in range(1, 9)]
    path = _file(tmp_path, "\n".join(",".join(str(v) for v in r) for r in rows))
    data = _load(path, 2)
    assert data.x_train.shape[0] + data.x_test.shape[0] == 8  # no row became a header
    with pytest.raises(ValueError, match="has no header line .* must be a column index 0..2, not a name"):
        _load(path, "y")
    headed = _file(tmp_path, "a,b,y\n" + "\n".join(",".join(str(v) for v in r) for r in rows), "h.csv")
    assert _load(headed, "y").x_train.shape[0] + _load(headed, "y").x_test.shape[0] == 8


@pytest.mark.parametrize("text,message", [
    ("a,b,y\n1,2,3\n4,5\n7,8,9\n", "line 3 has 2 fields, expected 3"),
    ("a,b,y\n1,2,3\n4,SECRET,6\n7,8,9\n", "line 3, column 2: not a number"),
    ("1,2,3\n\n4,5,6,SECRET\n7,8,9\n", "line 3 has 4 fields, expected 3"),
    ("a,b,y\n1,2,3\n4,1e307,6\n7,8,9\n", "line 3, column 2: NaN, infinite, or beyond float32's range"),
    ("a,b,y\n1,2,3\n4,nan,6\n7,8,9\n", "line 3, column 2: NaN, infinite"),
])
def test_csv_errors_name_line_and_column_without_contents(tmp_path, text, message):
    path = _file(tmp_path, text)
    with pytest.raises(ValueError, match=message) as info:
        _load(path, 2)
    assert "SECRET" not in str(info.value) and "1e307" not in str(info.value)


def test_values_beyond_float32_are_refused_before_standardisation(tmp_path):
    """The probe's case: one x column near 1e307 came out as all zeros and the cell was 'ok'."""
    import numpy as np

    x = np.linspace(1.0, 2.0, 40)[:, None] * np.array([[1.0, 1e307]])
    np.savez(tmp_path / "big.npz", x=x, y=np.arange(40.0))
    with pytest.raises(ValueError, match=r"array 'x': value at row 0, column 1 is beyond float32's range"):
        _load(tmp_path / "big.npz", "y")
    # a large but representable column standardises exactly (float64 statistics do not overflow)
    np.savez(tmp_path / "ok.npz", x=x / 1e270, y=np.arange(40.0))
    data = _load(tmp_path / "ok.npz", "y")
    xs = torch_cat(data)
    assert np.isfinite(xs).all() and xs[:, 1].std() > 0.5


def torch_cat(data):
    import numpy as np

    return np.concatenate([data.x_train.numpy(), data.x_test.numpy()])


def test_uci_data_beyond_float32_is_refused_naming_row_and_column(tmp_path):
    import numpy as np

    from pyrobdl.datasets import load_uci

    folder = tmp_path / "uci" / "yacht"
    folder.mkdir(parents=True)
    data = np.arange(30.0).reshape(10, 3)
    data[4, 1] = 1e307
    np.savetxt(folder / "data.txt", data)
    (folder / "index_features.txt").write_text("0\n1\n")
    (folder / "index_target.txt").write_text("2\n")
    (folder / "index_train_0.txt").write_text("\n".join(map(str, range(8))))
    (folder / "index_test_0.txt").write_text("8\n9\n")
    with pytest.raises(ValueError, match=r"data.txt': value at row 4, column 1 is beyond float32's range"):
        load_uci("yacht", 0, data_dir=tmp_path)
    data[4, 1] = 1e30  # representable: standardised, not zeroed
    np.savetxt(folder / "data.txt", data)
    d = load_uci("yacht", 0, data_dir=tmp_path)
    assert float(d.x_train[:, 1].abs().max()) > 1.0


def test_a_stray_class_label_is_refused_with_the_count(tmp_path):
    rows = "\n".join(f"{i},{i % 3 if i != 5 else 1000000}" for i in range(20))
    path = _file(tmp_path, "x,label\n" + rows)
    with pytest.raises(ValueError, match=r"largest class label is 1000000, i.e. 1000001 classes \(4 distinct labels\); "
                                         r"at most 1000"):
        _load(path, "label", "classification")
    suite = write_suite(tmp_path, SUITE.replace('source = "gap"\nnum_train = 20\nnum_test = 10',
                                               f'source = "file"\npath = "{path}"\ntarget = "label"\n'
                                               'task = "classification"')
                        .replace('likelihood = { kind = "gaussian", precision = 50.0 }',
                                 'likelihood = { kind = "categorical" }'))
    with pytest.raises(ConfigError, match="1000001 classes"):
        run(suite, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out" / "cells").iterdir())


@pytest.mark.parametrize("seeds", ["[-1]", "[4294967296]", f"[{2**70}]"])
def test_seeds_are_validated(seeds):
    with pytest.raises(ConfigError, match=r"suite.seeds: must be a non-empty list of integers in 0..2\*\*32-1"):
        parse_suite(tomllib.loads(SUITE.replace("[suite]", f"[suite]\nseeds = {seeds}")), "/x/s.toml")


@pytest.mark.parametrize("seed", [-1, 2**32, 2**70])
def test_fit_seed_is_validated(seed):
    import pyrobdl
    from pyrobdl.datasets import gap_regression

    d = gap_regression(10, 5, seed=0)
    with pytest.raises(ValueError, match=rf"seed must be in 0..2\*\*32-1 .*got {seed}"):
        pyrobdl.fit(pyrobdl.BayesianMLP(1, (3,), 1), d.x_train, d.y_train, "map", seed=seed, progress=False)


@pytest.mark.parametrize("text", [",,,", " , ", ""])
def test_an_empty_only_filter_is_an_error(tmp_path, capsys, text):
    with pytest.raises(ValueError, match="--only: no key=value entries"):
        parse_only(text)
    assert main(["compare", str(write_suite(tmp_path)), "--out", str(tmp_path / "o"), "--only", text]) == 2
    assert "--only: no key=value entries" in capsys.readouterr().err
    assert parse_only(None) == {}


def test_workers_are_capped_at_the_cells_with_a_warning_above_the_cores(tmp_path, capsys, monkeypatch):
    path = write_suite(tmp_path, SUITE.replace("[datasets.gap]", "[datasets.gap]\nsplits = [0, 1]"))
    assert main(["compare", str(path), "--out", str(tmp_path / "o"), "--workers", "1000", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "--workers 1000 capped at 2, the number of cells" in err
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert main(["compare", str(path), "--out", str(tmp_path / "o"), "--workers", "2", "--dry-run"]) == 0
    assert "--workers 2 is more than the 1 CPU core(s) available" in capsys.readouterr().err


def test_a_diverged_point_estimate_warns_and_the_cell_says_so(tmp_path):
    import pyrobdl
    from pyrobdl.datasets import gap_regression

    d = gap_regression(20, 5, seed=0)
    with pytest.warns(UserWarning, match=r"the map fit diverged: its objective went from .* lower lr \(now 1000000.0\)"):
        pyrobdl.fit(pyrobdl.BayesianMLP(1, (5,), 1), d.x_train, d.y_train, "map", seed=0, num_steps=100, lr=1e6,
                    progress=False)
    out = tmp_path / "out"
    assert run(write_suite(tmp_path, SUITE.replace("num_steps = 5", "num_steps = 100\nlr = 1e6")), out).success
    rec = read_result(out / "cells" / "gap__map__split-0__seed-0" / RESULT_FILE)
    assert any("fit: UserWarning: the map fit diverged" in w for w in rec["warnings"])


def test_write_error_crosses_process_boundaries():
    """Worker processes return it through pickling (the standard library's, on our own exception)."""
    import pickle

    e = pickle.loads(pickle.dumps(WriteError("/x/arrays.npz", "[Errno 28] No space left on device")))
    assert str(e) == "cannot write /x/arrays.npz: [Errno 28] No space left on device" and e.path == "/x/arrays.npz"


def test_write_error_in_a_pool_worker_stops_the_run(tmp_path, monkeypatch):
    """Through FuturesExecutor (threads here; processes return the same exception by pickling)."""
    import concurrent.futures as cf

    from pyrobdl.compare import FuturesExecutor

    path = write_suite(tmp_path, SUITE.replace("[datasets.gap]", "[datasets.gap]\nsplits = [0, 1]"))
    _fail_on(monkeypatch, "arrays.npz")
    with cf.ThreadPoolExecutor(2) as pool:
        with pytest.raises(WriteError, match=r"arrays.npz: \[Errno 28\]"):
            run(path, tmp_path / "out", executor=FuturesExecutor(pool))
    assert not list((tmp_path / "out").glob(f"cells/*/{RESULT_FILE}"))
