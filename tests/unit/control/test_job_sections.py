"""The job's settings are typed sections that mirror bamboo-train's flag groups
(bamboo/control/config.py, commands/train/flags.py): every field is its group's
flag or is named in DERIVED, every choice is its enum, and a stored config is
read back whole with each section's types checked."""
import json
from dataclasses import fields

import pytest

from schedules.options import Choice, JobRedundancy, JobReplicaSync
from bamboo.control import config as C
from bamboo.control.config import JobConfig, Precision
from bamboo.control.records import BadRecord
from commands.train import flags
from commands.train.cli import config_from_args
from commands.train.jobfile import parse_args, sections


def test_every_field_of_a_section_is_a_flag_of_the_same_group_or_derived():
    groups = sections(flags.build_parser())  # section -> key -> the flag's argparse action
    for f in fields(JobConfig):
        assert f.name in groups, f"JobConfig.{f.name} is no flag group"
        for setting in fields(f.default_factory):
            assert setting.name in groups[f.name] or setting.name in C.DERIVED, f"{f.name}.{setting.name}"
    named = {s.name for f in fields(JobConfig) for s in fields(f.default_factory)}
    assert set(C.DERIVED) <= named  # no stale entry


def test_every_choice_flag_is_an_enum_field_with_the_same_values():
    groups = sections(flags.build_parser())
    for f in fields(JobConfig):
        for setting in fields(f.default_factory):
            action = groups[f.name].get(setting.name)
            kind = C._ENUMS.get(setting.name)
            if action is not None and action.choices and setting.name not in ("dtype", "token_dtype"):
                assert kind is not None and issubclass(kind, Choice), setting.name
                assert set(action.choices) <= set(kind.values()), setting.name


def test_the_flags_make_the_sections_and_the_defaults_agree():
    args = parse_args(flags.build_parser(), ["--stages", "3", "--microbatches", "6", "--redundancy", "lazy",
                                             "--replica-sync", "next", "--precision", "bf16", "--job", "j"])
    cfg = config_from_args(args)
    assert (cfg.schedule.stages, cfg.schedule.microbatches, cfg.schedule.nodes) == (3, 6, 3)
    assert cfg.schedule.redundancy is JobRedundancy.LAZY and cfg.schedule.replica_sync is JobReplicaSync.NEXT
    assert cfg.recipe.precision is Precision.BF16 and cfg.cluster.job == "j" and not cfg.cluster.elastic
    defaults = config_from_args(parse_args(flags.build_parser(), []))
    built = JobConfig.of(run=defaults.checkpoints.run, layers=defaults.model.layers, val_fraction=0.05)
    assert defaults == built  # the dataclass defaults are the flags' defaults


def test_a_stored_config_reads_back_equal_and_a_bad_choice_is_refused_by_name():
    cfg = JobConfig.of(stages=4, redundancy="auto", frc="all", lr_schedule="cosine", transport="gloo",
                       preempt=(C.Preempt(1, 2, 3),), data_files=("a.bin",), betas=(0.8, 0.9))
    stored = json.loads(json.dumps(cfg.to_dict()))
    assert stored["schedule"]["redundancy"] == "auto" and stored["testing"]["preempt"][0]["instruction"] == 3
    assert JobConfig.from_dict(stored) == cfg
    stored["schedule"]["redundancy"] = "<b>eager</b>"
    with pytest.raises(BadRecord, match="redundancy must be one of eager, lazy, off, auto"):
        JobConfig.from_dict(stored)
    stored["schedule"] = {"stages": "4"}
    with pytest.raises(BadRecord, match="ScheduleSpec record's stages is str"):
        JobConfig.from_dict(stored)
    with pytest.raises(BadRecord, match="not a JSON object"):
        JobConfig.from_dict([1])
    with pytest.raises(BadRecord, match="keys that are no section: job, stages"):
        JobConfig.from_dict({"stages": 7, "job": "x"})  # the flat shape of before


def test_settings_named_by_field_land_in_their_sections():
    cfg = JobConfig.of(stages=5, lr=0.5, job="x")
    assert (cfg.schedule.stages, cfg.recipe.lr, cfg.cluster.job) == (5, 0.5, "x")
    assert cfg.with_(stages=2).schedule == cfg.schedule.__class__(stages=2) and cfg.with_(stages=2).recipe.lr == 0.5
    with pytest.raises(TypeError, match="no setting 'stage'"):
        JobConfig.of(stage=5)
