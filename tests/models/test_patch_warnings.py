"""A patched model trains as quietly as the unpatched one: no warning (Python's or transformers' logger) that the
unpatched model does not give, and the same loss. transformers renames arguments between releases (5.24 took
``past_key_values`` to ``cache`` and warns on the old name), so a patched forward that calls the base model with a
fixed set of names warns, or drops the cache, on the releases it was not written for."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings

import pytest
import torch

import torchport

from tiny_models import batch, build, to_device

transformers = pytest.importorskip("transformers")

CASES = ("llama", "qwen3", "gemma2-nocap")


@pytest.fixture(autouse=True)
def _clean():
    torchport.unpatch()
    yield
    torchport.unpatch()


@pytest.fixture
def transformers_log():
    """Messages of the ``transformers`` logger (it does not propagate to the root logger, so caplog alone misses
    them), with ``warning_once``'s memory cleared before each step."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname}: {record.getMessage()}")

    handler = Collect(level=logging.WARNING)
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    yield records
    root.removeHandler(handler)


def _train_step(model: torch.nn.Module, inputs: dict, log: list[str], **kwargs: object) -> tuple:
    """One SGD step; returns the output, the Python warnings and the transformers log messages it gave."""
    logging.Logger.warning_once.cache_clear()  # transformers' warning_once: a message seen before is not repeated
    log.clear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(**inputs, **kwargs)
        out.loss.backward()
        optimizer.step()
    return out, {f"{w.category.__name__}: {w.message}" for w in caught}, set(log)


def _pair(case: str, patch_classes: bool = False) -> tuple[torch.nn.Module, torch.nn.Module]:
    base = build(case)
    reference = to_device(base, torch.device("cpu"), torch.float32)
    if patch_classes:
        torchport.patch_transformers(reference.config.model_type)
        patched = to_device(base, torch.device("cpu"), torch.float32)
        return reference, patched
    return reference, torchport.patch(to_device(base, torch.device("cpu"), torch.float32))


@pytest.mark.parametrize("case", CASES)
def test_a_patched_training_step_warns_no_more_than_the_unpatched(case, transformers_log):
    reference, patched = _pair(case)
    inputs = batch(torch.device("cpu"))
    ref_out, ref_warnings, ref_log = _train_step(reference, inputs, transformers_log)
    out, patched_warnings, patched_log = _train_step(patched, inputs, transformers_log)
    assert out.logits is None  # the fused loss ran
    assert patched_warnings <= ref_warnings, patched_warnings - ref_warnings
    assert patched_log <= ref_log, patched_log - ref_log
    torch.testing.assert_close(out.loss, ref_out.loss)


def test_class_level_patch_trains_as_quietly(transformers_log):
    torchport.unpatch()
    reference, _ = _pair("llama")
    inputs = batch(torch.device("cpu"))
    ref_out, ref_warnings, ref_log = _train_step(reference, inputs, transformers_log)
    _, patched = _pair("llama", patch_classes=True)
    out, patched_warnings, patched_log = _train_step(patched, inputs, transformers_log)
    assert out.logits is None
    assert patched_warnings <= ref_warnings and patched_log <= ref_log, (patched_warnings, patched_log)
    torch.testing.assert_close(out.loss, ref_out.loss)


def _cache_field() -> str:
    """The name the installed transformers gives the key/value cache in a causal LM's output."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    names = {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}
    return "cache" if "cache" in names else "past_key_values"


def test_the_cache_reaches_the_base_model_and_comes_back(transformers_log):
    """use_cache in training: the base model makes a cache, and the patched output carries it under the installed
    name, as the unpatched output does."""
    reference, patched = _pair("llama")
    inputs = batch(torch.device("cpu"))
    ref_out, ref_warnings, ref_log = _train_step(reference, inputs, transformers_log, use_cache=True)
    out, patched_warnings, patched_log = _train_step(patched, inputs, transformers_log, use_cache=True)
    field = _cache_field()
    assert getattr(ref_out, field) is not None
    assert type(getattr(out, field)) is type(getattr(ref_out, field))
    assert getattr(out, field).get_seq_length() == getattr(ref_out, field).get_seq_length() == inputs["labels"].shape[1]
    assert patched_warnings <= ref_warnings and patched_log <= ref_log, (patched_warnings, patched_log)


def test_a_cache_given_by_the_installed_name_is_used():
    """A cache passed under the name the installed causal LM's forward has is filled by the base model."""
    reference, patched = _pair("llama")
    name = next(n for n in inspect.signature(type(reference).forward).parameters if n in ("cache", "past_key_values"))
    inputs = batch(torch.device("cpu"))
    for model in (reference, patched):
        cache = transformers.DynamicCache(config=model.config)
        model(**inputs, **{name: cache}).loss.backward()
        assert cache.get_seq_length() == inputs["labels"].shape[1]
