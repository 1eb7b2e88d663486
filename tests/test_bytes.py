import torch
from torch import nn

from torchport._bytes import format_bytes, weight_bytes


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (None, 512, 3 * 2**20, int(1.5 * 2**30), 200 * 2**30, 3 * 2**40)] == [
        "-", "512 B", "3.00 MiB", "1.50 GiB", "200 GiB", "3.00 TiB"]


def test_weight_bytes_counts_parameters_and_buffers() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    # linear 16 + 4, norm weight and bias 4 + 4, running mean and var 4 + 4 (float32), num_batches_tracked int64
    assert weight_bytes(model) == (16 + 4 + 4 + 4 + 4 + 4) * 4 + 8


def test_a_tied_weight_counts_once() -> None:
    embed, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = embed.weight  # one parameter in two modules
    assert weight_bytes(nn.ModuleList([embed, head])) == 40 * 4


def test_two_tensors_over_one_memory_count_once() -> None:
    a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    b.weight.data = a.weight.data  # two parameters, one storage
    assert b.weight is not a.weight
    assert weight_bytes(nn.ModuleList([a, b])) == 16 * 4


def test_disjoint_slices_of_one_storage_count_each() -> None:
    fused = torch.randn(3 * 4, 4)
    module = nn.Module()
    for i, name in enumerate("qkv"):
        module.register_buffer(name, fused[4 * i:4 * (i + 1)])
    assert weight_bytes(module) == 3 * 16 * 4


def test_meta_tensors_count_each() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert weight_bytes(model) == 2 * 20 * 4
