"""A flag of bamboo-train is declared once (commands/train/flags.py's GROUPS): a
made-up option added there shows in --help under its group, is a key of that
group's job-file section, and is checked alike from both."""
import pytest

from commands.train import flags, jobfile

RECIPE = 2  # GROUPS' recipe entry


@pytest.fixture
def with_made_up(monkeypatch):
    section, title, add = flags.GROUPS[RECIPE]

    def add_with_made_up(g):
        add(g)
        g.add_argument("--made-up-rate", type=float, default=0.5, metavar="R", help="a made-up option of the recipe")
    groups = list(flags.GROUPS)
    groups[RECIPE] = (section, title, add_with_made_up)
    monkeypatch.setattr(flags, "GROUPS", tuple(groups))
    return flags.build_parser()


def _error(parser, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        jobfile.parse_args(parser, argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip()


def test_a_made_up_option_is_a_flag_a_help_line_and_a_job_file_key(with_made_up, tmp_path, capsys):
    text = with_made_up.format_help()
    recipe = text[text.index("recipe:"):text.index("data:")]
    assert "--made-up-rate R" in recipe and "a made-up option of the recipe" in recipe
    assert jobfile.sections(with_made_up)["recipe"]["made_up_rate"].dest == "made_up_rate"
    job = tmp_path / "job.toml"
    job.write_text("[recipe]\nmade_up_rate = 0.25\n")
    assert jobfile.parse_args(with_made_up, ["--config", str(job)]).made_up_rate == 0.25
    assert jobfile.parse_args(with_made_up, ["--made-up-rate", "2"]).made_up_rate == 2.0
    assert jobfile.parse_args(with_made_up, []).made_up_rate == 0.5


def test_a_made_up_option_is_checked_alike_from_the_file_and_the_command_line(with_made_up, tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text('[recipe]\nmade_up_rate = "fast"\n')
    assert _error(with_made_up, ["--config", str(job)], capsys).endswith(
        "[recipe] made_up_rate: expected a number, got 'fast'")
    assert "--made-up-rate: invalid float value: 'fast'" in _error(with_made_up, ["--made-up-rate", "fast"], capsys)
    job.write_text("[model]\nmade_up_rate = 1.0\n")
    assert _error(with_made_up, ["--config", str(job)], capsys).endswith(
        "[model] made_up_rate: not a key of [model] (it belongs in [recipe])")
