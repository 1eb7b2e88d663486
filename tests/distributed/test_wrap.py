"""DDP and FSDP through torchport: two CPU processes (gloo) take the step one process takes on the whole batch."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import torchport.distributed as td

pytest.importorskip("transformers")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import step_worker  # noqa: E402

pytestmark = pytest.mark.slow  # two processes per case


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """Parameters after one step of one process on the whole batch."""
    model, tokens = step_worker.build()
    step_worker.step(model, tokens)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_step_like_one_and_their_checkpoint_loads_in_one(
    strategy: str, reference: dict[str, torch.Tensor], tmp_path: Path, run_python
) -> None:
    result = run_python("-m", "torchport", "run", "--nproc-per-node", "2", "--device", "cpu",
                        str(HERE / "step_worker.py"), strategy, str(tmp_path), cwd=tmp_path, timeout=240)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    # both ranks write to one pipe: their lines can interleave, so find the records rather than split lines
    assert sorted(re.findall(r"rank \d world \d", result.stdout)) == ["rank 0 world 2", "rank 1 world 2"], result.stdout
    params = torch.load(tmp_path / "params.pt")
    assert set(params) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=f"{strategy}: {name}")

    # the two-rank checkpoint loads into a plain model in this single process
    model, _ = step_worker.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    td.load_checkpoint(tmp_path / "ckpt", model, optimizer)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=f"{strategy} ckpt: {name}")
    assert len(optimizer.state) == sum(1 for _ in model.parameters())  # AdamW moments came back too


def test_checkpoint_of_another_model_fails_before_loading(tmp_path: Path) -> None:
    model, _ = step_worker.build()
    td.save_checkpoint(tmp_path / "ckpt", model)
    other = torch.nn.Sequential(torch.nn.Linear(3, 4))
    with pytest.raises(td.checkpoint.CheckpointError, match=r"\(written by 1 rank\(s\), strategy none\) does not fit this model: not in the checkpoint: 0.bias, 0.weight; in the checkpoint but not in the model: lm_head.weight, .* and 13 more"):
        td.load_checkpoint(tmp_path / "ckpt", other)
    with pytest.raises(td.checkpoint.CheckpointError, match="no checkpoint directory"):
        td.load_checkpoint(tmp_path / "missing", model)
    with pytest.raises(td.checkpoint.CheckpointError, match="holds no optimizer state"):
        td.load_checkpoint(tmp_path / "ckpt", model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.fixture
def group_of_one():
    import torch.distributed as dist

    device = td.init("cpu")
    yield device
    dist.destroy_process_group()


def test_reduction_dtype_follows_the_rank_count() -> None:
    from torchport.distributed.parallel import _reduce_dtype

    assert _reduce_dtype("auto", torch.bfloat16, 8) is torch.float32  # a rounding per partial sum: widen
    assert _reduce_dtype("auto", torch.float16, 3) is torch.float32
    assert _reduce_dtype("auto", torch.bfloat16, 2) is None  # one rounding either way
    assert _reduce_dtype("auto", torch.float32, 64) is None
    assert _reduce_dtype(None, torch.bfloat16, 64) is None
    assert _reduce_dtype("float32", torch.bfloat16, 2) is torch.float32


def test_bf16_gradients_reduced_in_fp32_when_asked(group_of_one) -> None:
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    wrapped = td.wrap(plain, "ddp", reduce_dtype=torch.float32)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    wrapped(x).float().square().sum().backward()
    grads = [p.grad.clone() for p in wrapped.parameters()]
    reference = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    reference.load_state_dict(wrapped.module.state_dict())
    reference(x).float().square().sum().backward()
    for g, r in zip(grads, (p.grad for p in reference.parameters())):
        torch.testing.assert_close(g, r)  # a group of one: the widened all-reduce is exact


def test_fsdp_shards_repeated_blocks(group_of_one) -> None:
    from torch.distributed.fsdp import FSDPModule

    model, tokens = step_worker.build()
    model.to(torch.bfloat16)
    wrapped = td.wrap(model, "fsdp", reduce_dtype="float32")
    sharded = [name for name, m in wrapped.named_modules() if isinstance(m, FSDPModule)]
    assert sharded == ["", "model.layers.0", "model.layers.1"]
    policy = wrapped.model.layers[0]._get_fsdp_state()._mp_policy
    assert policy.reduce_dtype == torch.float32 and policy.param_dtype is None
    loss = wrapped(input_ids=tokens, labels=tokens).loss
    loss.backward()
    assert all(p.grad is not None for p in wrapped.parameters())


def test_bad_input_is_named(group_of_one) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="strategy='zero3' is not a parallel strategy; valid: ddp, fsdp"):
        td.wrap(net, "zero3")
    with pytest.raises(TypeError, match="unknown DistributedDataParallel option.*bucket_size_mb; valid: .*bucket_cap_mb"):
        td.wrap(net, "ddp", bucket_size_mb=25)
    with pytest.raises(TypeError, match="unknown fully_shard option.*reshard; valid: .*reshard_after_forward"):
        td.wrap(net, "fsdp", reshard=True)
    with pytest.raises(ValueError, match="layers: no submodule of class 'Block'; the model has: Linear, Sequential"):
        td.wrap(net, "fsdp", layers=["Block"])
    with pytest.raises(ValueError, match="mixed_precision=.* is for FSDP"):
        td.wrap(net, "ddp", mixed_precision=torch.bfloat16)
    with pytest.raises(ValueError, match="mixed_precision='fp8' is not a floating dtype"):
        td.wrap(net, "fsdp", mixed_precision="fp8")
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    with pytest.raises(ValueError, match="mix dtypes \\(bfloat16, float32\\)"):
        td.wrap(mixed, "ddp")
    with pytest.raises(ValueError, match="no parameters"):
        td.wrap(torch.nn.ReLU(), "ddp")


def test_backend_the_device_lacks() -> None:
    with pytest.raises(ValueError, match="'nccl' cannot run on cpu tensors \\(it serves: cuda\\); use 'gloo'"):
        td.check_backend("nccl", "cpu")
    with pytest.raises(ValueError, match="'hcl' is not registered with torch.distributed \\(registered: .*gloo"):
        td.check_backend("hcl", "cpu")
    td.check_backend("gloo", "cpu")


def test_more_processes_than_devices_is_refused_before_launch(npu, capsys) -> None:
    from torchport.cli.main import main

    assert main(["run", "--nproc-per-node", "3", str(HERE / "step_worker.py"), "ddp", "x"]) == 2
    err = capsys.readouterr().err
    assert "--nproc-per-node 3 but this node has 1 npu device(s)" in err and "--device cpu" in err
    assert main(["run", "--master-port", "29999", str(HERE / "step_worker.py")]) == 2
    assert "--master-port is a torchrun option: give --nproc-per-node N with it" in capsys.readouterr().err
