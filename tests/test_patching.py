import copy
import pickle
import types

import pytest
import torch
from torch import nn

from torchport import _patching
from torchport._patching import MISSING, Journal


class Owner:
    inherited = "from the class"


def test_restore_puts_back_values_and_removes_what_was_not_there() -> None:
    module = types.ModuleType("m")
    module.f = "f"
    obj = Owner()
    journal = Journal()
    journal.set(module, "f", "patched")
    journal.set(module, "g", "new")
    journal.set(obj, "inherited", "own")  # the instance had no value of its own
    journal.set(module, "f", "twice")
    assert (module.f, module.g, obj.inherited) == ("twice", "new", "own")
    assert journal.patched() == [(module, "f"), (module, "g"), (obj, "inherited"), (module, "f")]
    assert journal.restore() == []
    assert module.f == "f" and not hasattr(module, "g")
    assert "inherited" not in vars(obj) and obj.inherited == "from the class"
    assert len(journal) == 0


def test_wrap_skips_missing_attributes_and_sees_the_current_value() -> None:
    module = types.ModuleType("m")
    module.f = lambda: 1
    journal = Journal()
    journal.wrap(module, "f", lambda fn: lambda: fn() + 1)
    journal.wrap(module, "absent", lambda fn: pytest.fail("no attribute to wrap"))
    assert module.f() == 2 and not hasattr(module, "absent")
    journal.restore()
    assert module.f() == 1


def test_items_keep_their_first_value_and_undo_runs_in_order() -> None:
    table = {"a": 1}
    order = []
    journal = Journal()
    journal.set_item(table, "a", 2)
    journal.undo(lambda: order.append(dict(table)))
    journal.set_item(table, "a", 3)  # the first value (1) is the one kept
    journal.set_item(table, "b", MISSING)
    journal.remember_item(table, "c")
    table["c"] = "added by hand"
    assert table == {"a": 3, "c": "added by hand"}
    journal.restore()
    assert table == {"a": 1}
    assert order == [{"a": 3}]  # undo steps run in their place: after the later changes were undone, before the first


def test_failures_are_returned_and_the_rest_is_undone() -> None:
    module = types.ModuleType("m")
    module.f = "f"
    journal = Journal()
    journal.set(module, "f", "patched")
    journal.undo(lambda: 1 / 0)
    failures = journal.restore()
    assert failures == ["ZeroDivisionError: division by zero"] and module.f == "f"


def test_the_marker_survives_copies_and_pickles() -> None:
    assert copy.deepcopy(MISSING) is MISSING and pickle.loads(pickle.dumps(MISSING)) is MISSING
    assert _patching.get_attr(Owner(), "inherited") is MISSING
    journal = Journal([(Owner, "x", MISSING)])
    Owner.x = 1
    journal.restore()
    assert not hasattr(Owner, "x")


def test_one_marker_and_one_journal_serve_compat_models_and_modes() -> None:
    from torchport import models
    from torchport.compat import redirect
    from torchport.modes import journal

    assert redirect.Patcher is Journal
    assert issubclass(journal.Journal, Journal)
    assert journal.Missing is MISSING and models._MISSING is MISSING


def test_a_mode_journal_parks_device_tensors_and_brings_them_back() -> None:
    from torchport.modes.journal import Journal as ModeJournal

    layer = nn.Linear(2, 2)
    meta = torch.empty(2, device="meta")
    journal = ModeJournal()
    journal.set_item(layer._parameters, "weight", None)
    journal.set_item(layer._buffers, "meta", meta)
    assert layer.weight is None
    journal.restore()
    assert isinstance(layer.weight, nn.Parameter) and "meta" not in layer._buffers


def test_shared_patches_go_back_when_the_last_holder_lets_go() -> None:
    from torchport._patching import SharedPatches

    module = types.ModuleType("m")
    module.f = "f"
    shared = SharedPatches()
    shared.hold(module, "f", lambda current: current + "+patched", holder="a")
    shared.hold(module, "f", lambda current: pytest.fail("patched once only"), holder="b")
    shared.hold(Owner, "inherited_only_here", lambda current: "new", holder="b")
    assert module.f == "f+patched" and shared.original(module, "f") == "f" and shared.holders() == {"a", "b"}
    shared.release("a")
    assert module.f == "f+patched" and shared
    shared.release("b")
    assert module.f == "f" and not hasattr(Owner, "inherited_only_here") and not shared
    assert shared.original(module, "f") == "f"
