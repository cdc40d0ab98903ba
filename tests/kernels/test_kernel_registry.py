"""The registry: preference order, requirements, and the DITQ_KERNELS / DITQ_DISABLE_KERNELS switches."""

from __future__ import annotations

import pytest
import torch

from ditq.errors import InputError
from ditq.kernels import ENV_DISABLE, ENV_FORCE, all_kernels, candidate_paths, get_kernel, register_kernel
from ditq.kernels.registry import unregister_kernel
from ditq.schemes import FP8, SCHEMES, W8A8

CPU = torch.device("cpu")


@pytest.fixture
def extra_cpu_path():
    """A second, preferred CPU w8a8 path (the reference's math) registered for the test only."""
    reference = get_kernel("cpu-reference-w8a8")
    register_kernel(
        name="test-preferred-w8a8",
        scheme=W8A8,
        device_type="cpu",
        prepare=reference.prepare,
        priority=50,
        alignment=16,
        activation_dtypes=frozenset({torch.bfloat16}),
    )(reference.matmul)
    yield get_kernel("test-preferred-w8a8")
    unregister_kernel("test-preferred-w8a8")


def test_every_scheme_has_a_cpu_reference() -> None:
    for scheme in SCHEMES.values():
        names = [p.name for p in candidate_paths(scheme, CPU, torch.bfloat16, 64, 32)]
        assert names == [f"cpu-reference-{scheme.name}"]


def test_cuda_paths_are_not_offered_on_cpu() -> None:
    cuda_paths = [p for p in all_kernels() if p.device_type == "cuda"]
    assert cuda_paths, "the CUDA paths register even where no GPU is present"
    for path in cuda_paths:
        ok, why = path.supports(CPU, torch.bfloat16, 4096, 4096)
        assert not ok and "cuda" in why


def test_preference_and_requirements(extra_cpu_path) -> None:
    names = [p.name for p in candidate_paths(W8A8, CPU, torch.bfloat16, 64, 32)]
    assert names == ["test-preferred-w8a8", "cpu-reference-w8a8"]
    # alignment 16 rules it out for 40 input features; fp16 is not among its dtypes.
    assert [p.name for p in candidate_paths(W8A8, CPU, torch.bfloat16, 40, 32)] == ["cpu-reference-w8a8"]
    ok, why = extra_cpu_path.supports(CPU, torch.float16, 64, 32)
    assert not ok and "float16" in why


def test_env_force_and_disable(extra_cpu_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_FORCE, "cpu-reference-w8a8")
    assert [p.name for p in candidate_paths(W8A8, CPU, torch.bfloat16, 64, 32)] == ["cpu-reference-w8a8"]
    # Forcing a w8a8 path leaves other schemes alone.
    assert [p.name for p in candidate_paths(FP8, CPU, torch.bfloat16, 64, 32)] == ["cpu-reference-fp8"]
    monkeypatch.delenv(ENV_FORCE)
    monkeypatch.setenv(ENV_DISABLE, "test-preferred-w8a8")
    assert [p.name for p in candidate_paths(W8A8, CPU, torch.bfloat16, 64, 32)] == ["cpu-reference-w8a8"]


def test_env_force_of_a_path_that_cannot_run_names_why(extra_cpu_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_FORCE, "test-preferred-w8a8")
    with pytest.raises(InputError, match=r"test-preferred-w8a8.*not multiples of 16"):
        candidate_paths(W8A8, CPU, torch.bfloat16, 40, 32)


def test_unknown_names_suggest_a_known_one(monkeypatch) -> None:
    with pytest.raises(InputError, match="did you mean 'cpu-reference-w8a8'"):
        get_kernel("cpu-refrence-w8a8")
    monkeypatch.setenv(ENV_DISABLE, "cpu-referense-fp8")
    with pytest.raises(InputError, match=f"{ENV_DISABLE}.*cpu-referense-fp8"):
        candidate_paths(FP8, CPU, torch.bfloat16, 64, 32)


def test_duplicate_registration_is_refused() -> None:
    reference = get_kernel("cpu-reference-fp8")
    with pytest.raises(ValueError, match="registered twice"):
        register_kernel(
            name="cpu-reference-fp8", scheme=FP8, device_type="cpu", prepare=reference.prepare, priority=0
        )(reference.matmul)


def test_row_helpers_call_a_cuda_op_directly_in_eager_mode_and_the_op_under_compile() -> None:
    """The custom op's Python dispatch costs host time an eager step cannot spare; torch.compile needs the op."""
    from ditq.kernels.cuda_common import cuda_op, matmul_rows, register_row_fakes

    calls: list[str] = []

    def rows(
        x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        calls.append("function")
        return x @ weight.t() * weight_scale

    op = cuda_op("ditq_test::rows_direct", rows)
    register_row_fakes(op)

    @op.register_kernel("cpu")
    def _(
        x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        calls.append("op")
        return x @ weight.t() * weight_scale

    torch.manual_seed(0)
    x = torch.randn(2, 3, 4)
    prepared = {"weight": torch.randn(5, 4), "weight_scale": torch.rand(5)}
    eager = matmul_rows(op, x, prepared, None)
    assert calls == ["function"] and eager.shape == (2, 3, 5)
    calls.clear()
    compiled = torch.compile(lambda t: matmul_rows(op, t, prepared, None), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), eager)
    assert calls == ["op"]


def test_extension_points_take_a_scheme_by_name_or_value_and_refuse_others_in_one_line() -> None:
    from ditq.kernels.attention import register_attention_kernel
    from ditq.kernels.reference import matmul_w8a16
    from ditq.schemes import W8A16

    for scheme in ("w8a16", "int8wo", W8A16):
        register_kernel(name="test-by-name", scheme=scheme, device_type="cpu", prepare=lambda s, d: s)(
            matmul_w8a16
        )
        try:
            assert get_kernel("test-by-name").scheme is W8A16
        finally:
            unregister_kernel("test-by-name")
    with pytest.raises(
        InputError, match=r"^scheme 'nvfp4': ditq implements w8a16, w8a8, fp8, w4a16, w4a8; other formats"
    ):
        register_kernel(name="bad", scheme="nvfp4", device_type="cpu", prepare=lambda s, d: s)
    with pytest.raises(InputError, match=r"^unknown scheme 'int9' .* did you mean"):
        register_kernel(name="bad", scheme="int9", device_type="cpu", prepare=lambda s, d: s)
    with pytest.raises(
        InputError, match="scheme must be one of w8a16, w8a8, fp8, w4a16, w4a8 or a ditq Scheme, got 8"
    ):
        register_kernel(name="bad", scheme=8, device_type="cpu", prepare=lambda s, d: s)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"unknown kind 'w8a16 \(weight-only\)'"):
        register_attention_kernel(
            name="bad", kind=W8A16, device_type="cpu", priority=0, quantize=lambda *a: a
        )  # type: ignore[arg-type]
    decorate = register_attention_kernel(name="test-fp8-kind", kind=FP8, device_type="cpu", priority=0,
                                         quantize=lambda *a: a)  # type: ignore[arg-type]  # fmt: skip
    assert callable(decorate)
