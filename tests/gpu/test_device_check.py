"""``scripts/device-check``, on a host without CUDA: it says so in one line and exits 0 (run as a
process, as a user runs it); bad arguments exit 2 with the reason; and its parts proven here: the
wheels it needs named when missing, a wheel unpacked into the install folder (its purelib part
moved up) beside links to this tree, the tree refused as that folder, and every test's outcome read
back from pytest's JUnit XML."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device-check"


def load_script():
    loader = importlib.machinery.SourceFileLoader("device_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("device_check", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path):
    result = run("nixl", "--wheels", str(tmp_path / "none"), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and "no CUDA device here" in result.stdout
    assert not (tmp_path / "out").exists()  # nothing installed, nothing written


@pytest.mark.parametrize("args, message", [
    (["tpu", "--wheels", "w", "--out", "o"], "invalid choice: 'tpu'"),
    (["nixl", "--out", "o"], "the following arguments are required: --wheels"),
    (["mooncake", "--wheels", "w", "--out", "o", "--budget-s", "10"], "--budget-s must be >= 60"),
])
def test_bad_arguments_exit_2_naming_the_problem(args, message):
    result = run(*args)
    assert result.returncode == 2 and message in result.stderr


def fake_wheel(path: Path, name: str, package: str | None = None) -> Path:
    """A wheel named ``name`` holding package ``package`` (default: ``name``) and a purelib part."""
    wheel = path / f"{name}-1.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    package = package or name
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{package}/__init__.py", "VALUE = 1\n")
        archive.writestr(f"{name}-1.0.data/purelib/{package}_extra.py", "EXTRA = 2\n")
        archive.writestr(f"{name}-1.0.dist-info/METADATA", "Name: x\n")
    return wheel


def test_the_wheels_it_needs_are_named_when_missing(tmp_path):
    check = load_script()
    fake_wheel(tmp_path, "msgspec")
    with pytest.raises(SystemExit, match=r"no nixl_cu13-\*\.whl in .*scripts/device-wheels"):
        check.wheels_for("nixl", str(tmp_path))
    fake_wheel(tmp_path, "nixl_cu13")
    with pytest.raises(SystemExit, match=r"no pyzmq-\*\.whl"):
        check.wheels_for("nixl", str(tmp_path))
    fake_wheel(tmp_path, "pyzmq")
    assert len(check.wheels_for("nixl", str(tmp_path))) == 3


def test_a_wheel_is_unpacked_beside_links_to_the_tree(tmp_path):
    check = load_script()
    site = tmp_path / "site"
    log = check.Log(str(tmp_path / "log"))
    check.install([str(fake_wheel(tmp_path, "engine"))], str(site), log)
    log.file.close()
    assert (site / "engine" / "__init__.py").read_text() == "VALUE = 1\n"
    assert (site / "engine_extra.py").exists() and not list(site.glob("*.data"))
    for name in ("plugin", "transfer"):
        assert os.path.realpath(site / "dsa_bridge" / name) == str(SCRIPT.parents[1] / name)
    env = dict(os.environ, PYTHONPATH=str(site))
    probe = subprocess.run([sys.executable, "-c", "import engine, engine_extra, "
                            "dsa_bridge.transfer.route_costs as m; print(m.__file__)"],
                           capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr


def test_the_tree_is_refused_as_the_install_folder(tmp_path):
    check = load_script()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("nixl_cu13", "msgspec", "pyzmq"):
        fake_wheel(wheels, name)
    args = check.parse(["nixl", "--wheels", str(wheels), "--out", str(tmp_path / "out"),
                        "--site", str(SCRIPT.parents[1] / "site")])
    with pytest.raises(SystemExit, match="is inside the tree"):
        check.check(args, "cpu")


def test_each_tests_outcome_is_read_from_junit_xml(tmp_path):
    check = load_script()
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='no device')\n"
        "def test_skipped(): pass\n")
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={junit}", str(tmp_path / "test_sample.py")],
                   capture_output=True, timeout=120, cwd=tmp_path)
    outcomes = {c["name"].split("::")[-1]: c for c in check.test_outcomes(str(junit))}
    assert {n: c["outcome"] for n, c in outcomes.items()} == {
        "test_ok": "passed", "test_bad": "failed", "test_skipped": "skipped"}
    assert "assert 1 == 2" in outcomes["test_bad"]["message"]
    assert outcomes["test_skipped"]["message"] == "no device"
    assert check.test_outcomes(str(tmp_path / "missing.xml")) == []


def test_the_whole_check_runs_here_with_stand_in_wheels(tmp_path):
    """Every step on this host, the engine wheel a stand-in without the engine: report.json
    names the import's error, counts the tier's tests (here every one skipped or deselected:
    no CUDA), holds the bench's answer, and the check fails (no test passed)."""
    check = load_script()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("nixl_cu13", "msgspec", "pyzmq"):  # packages of other names: the real msgspec stays
        fake_wheel(wheels, name, f"{name}_stand_in")
    out = tmp_path / "out"
    site = tmp_path / "site"
    args = check.parse(["nixl", "--wheels", str(wheels), "--out", str(out), "--site", str(site),
                        "--budget-s", "240"])
    assert check.check(args, "cpu") == 1
    report = json.loads((out / "report.json").read_text())
    assert "No module named 'nixl_cu13'" in report["engine_import"]
    assert report["test_counts"]["passed"] == report["test_counts"]["failed"] == 0
    assert all(t["outcome"] == "skipped" for t in report["tests"])
    assert report["steps"]["tests"]["exit"] in (0, 5)  # 5: every test deselected
    assert report["bench"] == ({"skipped": "no CUDA"} if not torch.cuda.is_available()
                               else report["bench"])
    assert report["ok"] is False and report["wheels"] == sorted(p.name for p in wheels.iterdir())
    assert {p.name for p in out.iterdir()} == {"report.json", "device-check.log", "junit.xml",
                                                "bench.json"}
    assert (site / "nixl_cu13_stand_in_extra.py").exists() and (site / "dsa_bridge").is_dir()
