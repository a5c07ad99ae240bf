"""The repository installs as one package, `kvf`: nothing named cli/pipeline/eval at the top level."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_holds_only_the_kvf_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("kvf-*.whl"))
    top_level = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert top_level == {"kvf", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("kvf/cli/main.py", "kvf/pipeline/fusion/engine.py", "kvf/cachestore/base.py", "kvf/eval/metrics.py",
                   "kvf/pipeline/fusion/methods/cacheblend.py"):
        assert module in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kvf = kvf.cli.entry:main" in entry_points


def test_kvf_help_from_another_directory(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvf", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0
    for command in ("demo", "build-cache", "run", "eval", "bench", "search", "store", "data"):
        assert command in proc.stdout


def test_make_help_names_only_targets_the_makefile_has():
    """`make help` prints the Makefile's header; each `make X` in it must be a target (make -n finds a rule)."""
    listed = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    targets = {word.strip("`:(),;.") for line in listed.splitlines() for i, word in enumerate(line.split())
               if i and line.split()[i - 1].strip("`") == "make" and not word.startswith("-")}
    assert {"demo", "test", "help", "verify", "kvfuse-curve"} <= targets, targets
    for target in sorted(targets):   # -q: asks whether it is up to date, runs nothing; 2 = no such rule
        assert subprocess.run(["make", "-q", target], cwd=ROOT, capture_output=True).returncode != 2, target
