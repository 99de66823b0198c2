"""Sessions: lint, tests (the locked env), dist (the built wheel in a clean
venv), npu_without_cann (torch-npu on a host without CANN), upstream (one env
per upstream.lock entry), matrix (every locked upstream x every parallel
layout), matrix_ci (CI's share of it), full (every test on every locked
upstream, then the whole matrix), transformers5 (the logits checks of models
only transformers 5 has), torchao (upstream's float8/MX training), docs.
`uv run nox` (CI) runs lint, tests, dist, npu_without_cann, the upstream
sessions of the non-default lock entries, torchao, and matrix_ci: a share of
the slow tests (tests/support.py FULL_SUITE)."""

import os
import shutil
import subprocess
import tempfile
import tomllib
import zipfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
LOCK = tomllib.loads((ROOT / "upstream.lock").read_text())["upstream"]
VERSIONS = [entry["version"] for entry in LOCK]
DEFAULT = next(entry["version"] for entry in LOCK if entry["default"])
DEFAULT_TORCH = next(entry["torch"] for entry in LOCK if entry["default"])
# Tracked entries (upstream main): CI runs a share of the suite on them.
TRACKED = [entry["version"] for entry in LOCK if entry["status"] == "tracked"]
# The matrix's `upgrade` cell: the newest entry of the other era -> DEFAULT.
_DEFAULT_ERA = next(e["era"] for e in LOCK if e["version"] == DEFAULT)
UPGRADE_FROM = next(e["version"] for e in LOCK if e["era"] != _DEFAULT_ERA)

# `tests` covers the default upstream in the locked env; `upstream` the others.
nox.options.sessions = [
    "lint",
    "tests",
    "dist",
    "npu_without_cann",
    *(f"upstream(version='{v}')" for v in VERSIONS if v not in (DEFAULT, *TRACKED)),
    *(f"tracked(version='{v}')" for v in TRACKED),
    *(f"torchao(version='{v}')" for v in (DEFAULT, UPGRADE_FROM)),
    "matrix_ci",
]
PYTHON = "3.11"
# titan-npu's own needs beyond torch + torchtitan (see pyproject.toml).
OWN_DEPS = [
    "tomli-w>=1.0",
    "pytest>=8",
    "pytest-xdist>=3.6",
    "matplotlib>=3.8",
    "transformers>=4.57,<5",
]
# The multimodal extra (torchvision) where an entry's torch is the default's:
# upstream main's qwen3_5 and kimi recipes import it.
MULTIMODAL = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
    "optional-dependencies"
]["multimodal"]


# Upstream snapshots PyPI does not have (tracked entries): a folder of their
# wheels, else their git source (GitHub).
WHEELS_ENV = "TITAN_NPU_UPSTREAM_WHEELS"
SHARED_WHEELS = ROOT.parent / "shared" / "upstream"


def snapshot_wheels(session: nox.Session, entry: dict) -> list[str]:
    """uv's options to find a tracked entry's wheel: the wheel folder (the
    environment variable, or ../shared/upstream when present), else its git
    source; where neither is reachable the session says so and skips."""
    folder = Path(os.environ.get(WHEELS_ENV) or SHARED_WHEELS)
    if any(folder.glob(f"torchtitan-{entry['version']}-*.whl")):
        return ["--find-links", str(folder)]
    url = entry["source"].split("git+", 1)[-1].rsplit("@", 1)[0]
    try:
        subprocess.run(
            ["git", "ls-remote", url], check=True, timeout=30, capture_output=True
        )
        return []  # uv builds the locked commit from its git source
    except (OSError, subprocess.SubprocessError):
        pass
    session.skip(
        f"torchtitan {entry['version']} (upstream main {entry['commit'][:7]}): no "
        f"wheel in {folder} and its git source is unreachable; set {WHEELS_ENV} to "
        "a folder holding the snapshot wheel"
    )
    return []


def upstream_env(session: nox.Session, version: str, extra: str = "") -> Path:
    """A cached venv with one locked upstream, its wheel hash-checked; with
    ``extra`` (a requirement such as "torchao==0.18.0"), a venv of its own
    that has it too. A tracked snapshot comes from its wheel folder
    (hash-checked) or its git source (the locked commit)."""
    entry = next(e for e in LOCK if e["version"] == version)
    name = extra.split("==")[0] if extra else "upstream"
    env = ROOT / ".nox" / f"{name}-{version}"
    run = {"env": {"VIRTUAL_ENV": str(env)}, "external": True}
    found = snapshot_wheels(session, entry) if entry.get("source") else []
    if not (env / "bin" / "python").exists():
        session.run("uv", "venv", "--quiet", "--python", PYTHON, str(env), **run)
    pip = ["uv", "pip", "install", "--quiet"]
    requirement = env / "upstream-requirement.txt"
    if entry.get("source") and not found:
        pinned = entry["source"]  # the git source at the locked commit
    else:
        pinned = f"torchtitan=={version}"
        requirement.write_text(f"{pinned} --hash=sha256:{entry['wheel_sha256']}\n")
        # The upstream wheel must be byte-for-byte the locked one.
        session.run(
            *pip, *found, "--require-hashes", "--no-deps", "-r", str(requirement),
            **run,
        )  # fmt: skip
    session.run(
        *pip,
        *found,
        f"torch=={entry['torch']}",
        pinned,
        *OWN_DEPS,
        *(MULTIMODAL if entry["torch"] == DEFAULT_TORCH else []),
        *filter(None, [extra]),
        **run,
    )
    session.run(*pip, "--no-deps", "-e", str(ROOT), **run)
    session.run(env / "bin" / "titan-npu", "compat", "check", external=True)
    return env


@nox.session(venv_backend="none")
def lint(session):
    session.run("uv", "run", "--frozen", "ruff", "check", ".")
    session.run("uv", "run", "--frozen", "ruff", "format", "--check", ".")
    session.run("uv", "run", "--frozen", "pyrefly", "check")  # types of the package


@nox.session(venv_backend="none")
def quick(session):
    """The inner loop: unit tests only (no torchrun launches, no matrix, one
    model of each heavy parametrization)."""
    session.run(
        "uv", "run", "--frozen", "pytest", "-n", "2", "-q",
        "-m", "not e2e and not heavy",
        *session.posargs, external=True,
    )  # fmt: skip


@nox.session(venv_backend="none")
def tests(session):
    """Unit + end-to-end tests in the locked environment (default upstream)."""
    session.run("uv", "run", "--frozen", "pytest", "-n", "2", *session.posargs)


def wheel_files(wheel: Path) -> dict[str, str]:
    """``{path: sha256 from RECORD}`` of a wheel (RECORD itself excluded)."""
    with zipfile.ZipFile(wheel) as archive:
        record = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        rows = [line.split(",") for line in archive.read(record).decode().split()]
    return {row[0]: row[1] for row in rows if row[0] != record}


@nox.session(venv_backend="none")
def dist(session):
    """Build wheel + sdist, install the wheel with the locked dependencies into
    a fresh venv outside the repo, and use it from an empty directory."""
    tmp = Path(tempfile.mkdtemp(prefix="titan-npu-dist-"))
    direct, from_sdist = tmp / "direct", tmp / "from-sdist"
    session.run("uv", "build", "--wheel", "--out-dir", str(direct), external=True)
    # uv's default: the sdist first, then a wheel built from that sdist.
    session.run("uv", "build", "--out-dir", str(from_sdist), external=True)
    wheel = next(direct.glob("*.whl"))
    files = wheel_files(wheel)
    if files != wheel_files(next(from_sdist.glob("*.whl"))):
        session.error("the wheel built from the sdist differs from the direct one")
    with zipfile.ZipFile(wheel) as archive:
        packaged = archive.read("torchtitan_npu/upstream.lock")
    if packaged != (ROOT / "upstream.lock").read_bytes():
        session.error("the wheel's upstream.lock is not the repository's")
    configs = [f for f in files if f.endswith(".toml") and "train_configs" in f]
    session.log(f"wheel: {len(files)} files, lock + {len(configs)} train configs")

    venv, run = tmp / "venv", {"external": True}
    session.run("uv", "venv", "--quiet", "--python", PYTHON, str(venv), **run)
    requirements = tmp / "requirements.txt"
    session.run(
        "uv", "export", "--frozen", "--no-dev", "--no-emit-project",
        "--quiet", "--output-file", str(requirements), **run,
    )  # fmt: skip
    pip = ["uv", "pip", "install", "--quiet", "--python", str(venv / "bin" / "python")]
    session.run(*pip, "--require-hashes", "-r", str(requirements), **run)
    session.run(*pip, "--no-deps", str(wheel), **run)
    session.run(
        venv / "bin" / "python", ROOT / "tests" / "install" / "installed_check.py",
        tmp / "work",
        env={"TITAN_NPU_CACHE": str(tmp / "cache"), "TITAN_NPU_DEVICE": "cpu"},
        **run,
    )  # fmt: skip
    shutil.rmtree(tmp)


@nox.session(venv_backend="none")
def npu_without_cann(session):
    """The real torch-npu wheel on a host without CANN (it breaks `import
    torch`): the escape hatch trains, the unforced launch fails in one line."""
    env = ROOT / ".nox" / "npu-without-cann"
    run = {"external": True}
    python = env / "bin" / "python"
    if not python.exists():
        session.run("uv", "venv", "--quiet", "--python", PYTHON, str(env), **run)
    requirements = env / "requirements.txt"
    session.run(
        "uv", "export", "--frozen", "--no-dev", "--no-emit-project", "--extra", "npu",
        "--quiet", "--output-file", str(requirements), **run,
    )  # fmt: skip
    pip = ["uv", "pip", "install", "--quiet", "--python", str(python)]
    session.run(*pip, "--require-hashes", "-r", str(requirements), **run)
    session.run(*pip, "--no-deps", "-e", str(ROOT), **run)
    # titan-npu's torch_npu calls against the wheel's own schemas (no import)
    (torch_npu,) = env.glob("lib/python*/site-packages/torch_npu")
    session.run(
        python, ROOT / "tests" / "install" / "npu_contract.py", torch_npu, **run
    )
    tmp = Path(tempfile.mkdtemp(prefix="titan-npu-no-cann-"))
    session.run(
        python, ROOT / "tests" / "install" / "npu_without_cann.py", tmp / "work",
        env={"TITAN_NPU_CACHE": str(ROOT / ".nox" / "assets-cache")},
        **run,
    )  # fmt: skip
    shutil.rmtree(tmp)


@nox.session(venv_backend="none")
@nox.parametrize("version", VERSIONS)
def upstream(session, version):
    """The suite, real training included, against one locked upstream."""
    env = upstream_env(session, version)
    basetemp = ROOT / "outputs" / "e2e" / version  # runs stay inspectable
    basetemp.parent.mkdir(parents=True, exist_ok=True)
    session.run(
        env / "bin" / "pytest", "-n", "2", "--basetemp", str(basetemp),
        *session.posargs, external=True,
    )  # fmt: skip


# CI's share on a tracked upstream (the same cells `titan-npu compat sync`
# runs): the single-device reference, FSDP, TP, a resume across layouts,
# fine-tuning an HF checkpoint. `nox -s upstream` / `full` run everything.
TRACKED_MATRIX = "single,fsdp,tp,resume_fsdp_to_single,hf_finetune"


@nox.session(venv_backend="none")
@nox.parametrize("version", TRACKED or [None])
def tracked(session, version):
    """CI's share on a tracked upstream: the unit tests, then the core matrix
    cells."""
    if version is None:
        session.skip("upstream.lock has no tracked entry")
    env = upstream_env(session, version)
    session.run(
        env / "bin" / "pytest", "-n", "2", "-q", "-m", "not e2e and not heavy",
        *session.posargs, external=True,
    )  # fmt: skip
    run_matrix(session, {version: TRACKED_MATRIX}, [])


# torchao runs upstream's float8 / MX / NVFP4 training; its emulated float8
# trains on CPU. Not a dependency of titan-npu: a user installs it.
TORCHAO = "torchao==0.18.0"


@nox.session(venv_backend="none")
@nox.parametrize("version", [DEFAULT, UPGRADE_FROM])
def torchao(session, version):
    """Upstream's low-precision training with torchao installed, on the newest
    upstream of each era (tests/test_quantization.py)."""
    env = upstream_env(session, version, extra=TORCHAO)
    session.run(
        env / "bin" / "pytest", "tests/test_quantization.py", *session.posargs,
        external=True,
    )  # fmt: skip


@nox.session(venv_backend="none")
def matrix(session):
    """Every locked upstream x every layout; prints the table, writes plots.

    `nox -s matrix -- --upstream 0.3.0,0.2.2 --layout fsdp,tp`
    """
    args = list(session.posargs)
    chosen = {"--upstream": ",".join(VERSIONS), "--layout": "all"}
    for flag in chosen:
        if flag in args:
            i = args.index(flag)
            chosen[flag] = args[i + 1]
            del args[i : i + 2]
    versions = chosen["--upstream"].split(",")
    unknown = sorted(set(versions) - set(VERSIONS))
    if unknown:
        session.error(f"not in upstream.lock: {unknown}; locked: {VERSIONS}")
    run_matrix(session, {v: chosen["--layout"] for v in versions}, args)


# CI's share of the matrix (the whole one takes ~50 min on 2 cores): on the
# default upstream one cell per mechanism -- the single-device reference,
# FSDP, PP, CP, selective AC, the injected qwen2, the kernel converters on
# the 2-D (FSDP x TP) mesh (TP's cell), fine-tuning a user's own HF llama, a
# resume under another layout -- and the core layouts on the newest of the
# other era. The rest (ddp, hsdp, tp alone, fsdp_tp, the other PP schedules
# and PP x FSDP, every qwen2 layout, the other resume pairs, upstream's other
# models (8-14 min a cell), the 0.2.2 -> 0.3.0 `upgrade` cell: 4 min; CI
# migrates a checkpoint of the other era in tests/test_checkpoint_migrate)
# is `nox -s matrix`.
CI_MATRIX = {
    DEFAULT: "single,fsdp,pp_1f1b,cp,fsdp_ac_selective,qwen2_fsdp,"
    "converters_fsdp_tp,hf_finetune,resume_fsdp_to_single",
    "0.2.2": "single,fsdp,pp_1f1b",
}


@nox.session(venv_backend="none")
def matrix_ci(session):
    """The part of the matrix CI runs (see CI_MATRIX)."""
    run_matrix(session, CI_MATRIX, list(session.posargs))


def run_matrix(session: nox.Session, layouts: dict[str, str], args: list[str]):
    out = ROOT / "outputs" / "matrix"
    (out / "work").mkdir(parents=True, exist_ok=True)
    envs = {v: upstream_env(session, v) for v in layouts}
    for version, chosen in layouts.items():
        env, more = envs[version], []
        if version == DEFAULT and (chosen == "all" or "upgrade" in chosen.split(",")):
            older = envs.get(UPGRADE_FROM) or upstream_env(session, UPGRADE_FROM)
            more = ["--upgrade-from", str(older / "bin" / "python")]
        session.run(
            env / "bin" / "pytest", "tests/matrix", "-m", "matrix",
            "--layout", chosen,
            "--matrix-results", str(out / "results" / f"{version}.json"),
            "--basetemp", str(out / "work" / version),
            "--tb=short",  # the rank's error, not pages of launcher source
            *more,
            *args,
            external=True,
            success_codes=[0, 1],  # a red cell is reported in the table below
        )  # fmt: skip
    paths = os.pathsep.join(str(ROOT / "tests" / d) for d in ("matrix", "."))
    session.run(
        ROOT / ".nox" / f"upstream-{next(iter(layouts))}" / "bin" / "python",
        "tests/matrix/report.py", str(out / "results"), str(out),
        env={"PYTHONPATH": paths},
        external=True,
    )  # fmt: skip


@nox.session(venv_backend="none")
def full(session):
    """Every test on every locked upstream (FULL_SUITE: no CI share), then the
    whole matrix. ~2.5 h on 2 cores."""
    env = {"TITAN_NPU_FULL_SUITE": "1"}
    session.run("uv", "run", "--frozen", "pytest", "-n", "2", env=env, external=True)
    for version in VERSIONS:
        if version != DEFAULT:
            pytest = upstream_env(session, version) / "bin" / "pytest"
            session.run(pytest, "-n", "2", env=env, external=True)
    run_matrix(session, {v: "all" for v in VERSIONS}, [])


@nox.session(venv_backend="none")
def device(session):
    """The device check on a CUDA or Ascend host (not in CI): doctor, the npu
    kernels against their references, device vs CPU numerics, speed against
    upstream's launcher, plan vs measured memory; one markdown report. On a
    CPU-only host, a dry run saying what it would check."""
    session.run(
        "uv", "run", "--frozen", "python", "benchmarks/device_check.py",
        *session.posargs, external=True,
    )  # fmt: skip


# The adapter tests of models only transformers 5 has (Qwen3.5, Kimi K2.5).
TRANSFORMERS5_TESTS = ["tests/test_hf_multimodal.py"]


@nox.session(venv_backend="none")
def transformers5(session):
    """The default upstream with transformers 5 (the project pins 4.x): the
    logits checks of the models transformers 4 lacks."""
    entry = next(e for e in LOCK if e["version"] == DEFAULT)
    env = ROOT / ".nox" / "transformers5"
    run = {"env": {"VIRTUAL_ENV": str(env)}, "external": True}
    if not (env / "bin" / "python").exists():
        session.run("uv", "venv", "--quiet", "--python", PYTHON, str(env), **run)
    own = [d for d in OWN_DEPS if not d.startswith("transformers")]
    pip = ["uv", "pip", "install", "--quiet"]
    session.run(
        *pip, f"torch=={entry['torch']}", f"torchtitan=={DEFAULT}", *own,
        "transformers>=5.2,<5.25", "torchvision", **run,
    )  # fmt: skip
    session.run(*pip, "--no-deps", "-e", str(ROOT), **run)
    session.run(env / "bin" / "pytest", *TRANSFORMERS5_TESTS, *session.posargs, **run)


@nox.session(venv_backend="none")
def docs(session):
    """Regenerate docs/versioning_policy.md and docs/patches.md."""
    session.run("uv", "run", "--frozen", "titan-npu", "compat", "docs")
