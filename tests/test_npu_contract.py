"""The torch_npu contract checker (tests/install/npu_contract.py, run on the
locked wheel by `nox -s npu_without_cann`) finds each kind of broken call."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "install"))
import npu_contract  # noqa: E402

# The schemas are one line each, as torch_npu writes them.
DOCS = '''
_add_torch_npu_docstr(
    "npu_rms_norm",
    """
接口原型:
torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)
""",
)
_add_torch_npu_docstr(
    "npu_grouped_matmul",
    """
npu_grouped_matmul(x, weight, *, bias=None, group_list=None, int[]? tuning_config) -> List[torch.Tensor]
""",
)
_add_torch_npu_docstr(
    "npu_swiglu",
    """
torch_npu.npu_swiglu(Tensor self, int dim=-1) -> (Tensor)
""",
)
'''  # noqa: E501


def problems(tmp_path, source: str) -> list[str]:
    package = tmp_path / "pkg"
    package.mkdir(exist_ok=True)
    (package / "ops.py").write_text(source)
    return npu_contract.check_ops(DOCS, package)


def test_the_schemas_are_read_from_the_docstrings_prototype_lines():
    found = npu_contract.schemas(DOCS)
    (norm,) = found["npu_rms_norm"]
    assert norm.positional == ("self", "gamma", "epsilon") and norm.returns == 2
    assert norm.required == {"self", "gamma"}
    (gmm,) = found["npu_grouped_matmul"]
    assert gmm.keyword_only == ("bias", "group_list", "tuning_config")
    assert gmm.required == {"x", "weight"} and gmm.listed
    assert found["npu_swiglu"][0].returns is None  # "(Tensor)": one value


def test_calls_that_fit_their_schemas_pass(tmp_path):
    source = (
        "def f(torch_npu, x, w, a, b, offs):\n"
        "    y = torch_npu().npu_rms_norm(x, w, epsilon=1e-5)[0]\n"
        "    out, rstd = torch_npu.npu_rms_norm(x, w)\n"
        "    z = torch_npu().npu_grouped_matmul([a], [b], group_list=offs)[0]\n"
        "    return torch_npu().npu_swiglu(x, dim=-1)\n"
    )
    assert problems(tmp_path, source) == []


@pytest.mark.parametrize(
    ("call", "problem"),
    [
        ("torch_npu().npu_rms_norm(x, w, epsilonn=1e-5)", "no parameter 'epsilonn'"),
        (
            "torch_npu().npu_rms_norm(x, w, 1e-5, 3)",
            "4 positional arguments; it takes 3",
        ),
        ("torch_npu().npu_rms_norm(x)", "required 'gamma' not given"),
        ("torch_npu().npu_rms_norm(x, w)[2]", "[2] of a 2-tuple"),
        ("torch_npu().npu_swiglu(x)[0]", "[0] of a single result"),
        ("torch_npu().npu_grouped_matmul([x], [w], [b])", "3 positional arguments"),
        ("torch_npu().npu_rms_norm_fused(x, w)", "no such op"),
    ],
)
def test_each_kind_of_broken_call_is_named(tmp_path, call, problem):
    (found,) = problems(tmp_path, f"def f(torch_npu, x, w, b):\n    return {call}\n")
    assert found.startswith("pkg/ops.py:2: torch_npu.") and problem in found


def test_an_unpacking_must_match_the_returned_tuple(tmp_path):
    source = "def f(torch_npu, x, w):\n    a, b, c = torch_npu().npu_rms_norm(x, w)\n"
    (found,) = problems(tmp_path, source)
    assert found.endswith("unpacked into 3; it returns 2")


def test_the_profiler_keywords_are_checked_against_torch_npus_classes(tmp_path):
    """titan-npu's own reporting/npu_profiler.py against a torch_npu whose
    schedule lacks skip_first_wait (as its docs once said) and whose profiler
    module exports no ProfilerActivity."""
    profiler = tmp_path / "torch_npu" / "profiler"
    profiler.mkdir(parents=True)
    (profiler / "__init__.py").write_text(
        "from .profiler import profile\nfrom .scheduler import Schedule as schedule\n"
    )
    (profiler / "profiler.py").write_text(
        "class profile:\n    def __init__(self, *, activities=None, schedule=None,"
        " on_trace_ready=None, **kwargs): pass\n"
    )
    (profiler / "scheduler.py").write_text(
        "class Schedule:\n    def __init__(self, wait, active, warmup=0, repeat=0,"
        " skip_first=0): pass\n"
    )
    found = npu_contract.check_profiler(tmp_path / "torch_npu", npu_contract.PACKAGE)
    assert any(p.endswith("has no 'ProfilerActivity'") for p in found), found
    assert any(
        p.endswith("torch_npu.profiler.schedule has no parameter 'skip_first_wait'")
        for p in found
    ), found
