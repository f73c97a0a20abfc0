"""The flags ``calibrate`` and ``submit`` share are declared once (``RunFlags``) and reach both
commands alike, each command's own flags in their place."""

from __future__ import annotations

from dataclasses import fields

import pytest
import typer.main

from bnrecal.service.cli import options as opt
from bnrecal.service.cli.main import app


def command_options(name: str) -> list[tuple[str, tuple[str, ...], str | None, object, bool]]:
    """Each option of a command as click sees it: name, spellings, help, default, hidden."""
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return [(p.name, tuple(p.opts), getattr(p, "help", None), p.default, getattr(p, "hidden", False))
            for p in command.params]


def test_both_commands_take_every_shared_flag_in_the_declared_order():
    shared = [field.name for field in fields(opt.RunFlags)]
    calibrate, submit = command_options("calibrate"), command_options("submit")
    for command in (calibrate, submit):
        assert [option[0] for option in command if option[0] in shared] == shared
    assert [o for o in calibrate if o[0] in shared] == [o for o in submit if o[0] in shared]


def test_each_command_places_its_own_flags_where_help_always_listed_them():
    names = [option[0] for option in command_options("submit")]
    assert names[names.index("out") + 1] == "server" and names[names.index("program") + 1] == "api_key"
    assert names[names.index("transform") + 1] == "ray_address"
    calibrate = [option[0] for option in command_options("calibrate")]
    assert calibrate[calibrate.index("transform") + 1] == "ray_address"
    hidden = {o[0]: o[4] for o in command_options("submit")}
    assert hidden["ray_address"] and not dict((o[0], o[4]) for o in command_options("calibrate"))["ray_address"]


def test_a_command_must_say_where_its_own_flags_go():
    def command(flags: opt.RunFlags, extra: int = 0) -> None:
        """A command with a flag of its own and no place for it."""

    with pytest.raises(TypeError, match="place each own flag"):
        opt.run_command()(command)
    placed = opt.run_command(extra="seed")(command)
    assert placed.__doc__ == command.__doc__


def test_the_flags_arrive_as_one_object(tmp_path):
    seen: list[tuple[opt.RunFlags, int]] = []

    @opt.run_command(extra="seed")
    def command(flags: opt.RunFlags, extra: int = 0) -> None:
        seen.append((flags, extra))

    test_app = typer.Typer()
    test_app.command()(command)
    test_app.command("other")(lambda: None)  # two commands: typer names them
    typer.main.get_command(test_app).main(
        ["command", "--data", "x.npy", "--out", str(tmp_path / "o.pt"), "-k", "3", "--extra", "7"],
        standalone_mode=False,
    )
    flags, extra = seen[0]
    assert (flags.data, flags.workers, flags.mode.value, extra) == ("x.npy", 3, "sync", 7)


def test_every_recalibration_option_has_one_flag_declared_once_for_every_command():
    """``bnrecal.RecalibrationOptions``' fields are the run option flags, declared once
    (``RECALIBRATION_FLAGS``) and taken by calibrate, submit and sweep alike, in one order."""
    import bnrecal
    from bnrecal.service.cli.sweep import SweepFlags

    declared = [name for name, _, _ in opt.RECALIBRATION_FLAGS]
    assert sorted(declared) == sorted(bnrecal.RecalibrationOptions.model_fields)
    seen = {}
    for command, kind in (("calibrate", opt.RunFlags), ("submit", opt.RunFlags), ("sweep", SweepFlags)):
        assert [field.name for field in fields(kind) if field.name in declared] == declared, command
        options = {option[0]: option[1:] for option in command_options(command) if option[0] in declared}
        seen.setdefault("calibrate", options)
        assert options == seen["calibrate"], command  # the same spellings, help, defaults everywhere
