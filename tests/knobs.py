"""knobs(mp, **changes): set the launchers' knobs (m2ops.kernels.config) for one test, undone by the MonkeyPatch mp
(the `monkeypatch` fixture, or pytest.MonkeyPatch.context())."""

from __future__ import annotations


def knobs(mp, **changes) -> None:
    from m2ops.kernels import config
    mp.setattr(config, "_CURRENT", [config.current().replace(**changes)])
