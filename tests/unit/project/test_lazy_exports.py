"""Read-through lazy packages (``megatron_rl.lazy``): an export set on the package would
shadow its defining module for good (four rollout tests failed by test order after a test
patched ``megatron_rl.platform.get_platform``: the undo left the real function behind, and
later patches of ``megatron_rl.platform.device.get_platform`` went unseen)."""

from __future__ import annotations

import pytest


def test_setting_an_export_of_a_read_through_package_is_refused_naming_where_to_set_it():
    import megatron_rl.platform as platform

    with pytest.raises(AttributeError, match="set megatron_rl.platform.device.get_platform"):
        platform.get_platform = lambda: None
    assert "get_platform" not in vars(platform)  # nothing left behind
    platform.some_other_name = 1  # other names are the package's own
    del platform.some_other_name


def test_a_patch_of_the_defining_module_is_what_the_package_gives(monkeypatch):
    import megatron_rl.platform.device as device

    marker = object()
    monkeypatch.setattr(device, "get_platform", lambda: marker)
    from megatron_rl.platform import get_platform

    assert get_platform() is marker
