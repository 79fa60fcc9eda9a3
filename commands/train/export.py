"""`bamboo-export --checkpoint DIR|s3://BUCKET/PREFIX|gs://BUCKET/PREFIX OUT`: a
job's checkpoint as the model `--export` writes (for a Hugging Face model, a
directory `from_pretrained` loads), from this machine, after the job. That is
how a cloud job's model comes out: its nodes write checkpoints to the bucket.

The newest committed checkpoint is taken, or the one taken before `--iteration N`;
its layers are read one at a time (a large model is never held whole with its
optimizer state), each checked against the hash its commit record names. The
commit record names the model (its section of the job's config); a checkpoint
written before records did, or a factory model (a record from a bucket never
makes this machine import a module), needs the model's flags given again.
"""
from __future__ import annotations

import sys

from bamboo.control.config import DTYPES, ModelSpec
from bamboo.control.parser import OneLineParser
from bamboo.control.records import BadRecord
from bamboo.data.checkpoint_files import (Attempt, CheckpointError, commit_hashes, commit_record, committed,
                                          read_layer, storage_for)
from bamboo.model.api import ModelSource
from bamboo.state.checkpoint import loaded


class ExportInputError(ValueError):
    """The checkpoint, its model or OUT cannot be used; the message says which."""


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog="bamboo-export", description="A job's checkpoint as a model: safetensors, and for "
                       "hf: models a directory from_pretrained loads.")
    ap.add_argument("out", metavar="OUT", help="the directory to write (absent or empty)")
    ap.add_argument("--checkpoint", required=True, metavar="DIR|s3://BUCKET/PREFIX|gs://BUCKET/PREFIX",
                    help="the job's --checkpoint")
    ap.add_argument("--iteration", type=int, metavar="N",
                    help="the checkpoint taken before iteration N (default: the newest complete one)")
    model = ap.add_argument_group("the model, for a checkpoint whose records do not name it")
    model.add_argument("--model", help="as bamboo-train's --model")
    model.add_argument("--model-config", metavar="FILE.json", help="as bamboo-train's --model-config")
    model.add_argument("--seq", type=int, default=32, help="as bamboo-train's --seq")
    model.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                       help="as bamboo-train's --dtype")
    return ap


def given_model(args) -> ModelSpec | None:
    """The model the flags name, if they name one."""
    if args.model is None and args.model_config is None:
        return None
    config_json = None
    if args.model_config is not None:
        try:
            with open(args.model_config) as f:
                config_json = f.read()
        except OSError as e:
            raise ExportInputError(f"--model-config {args.model_config!r}: cannot read it ({e.strerror})") from None
    name = "hf:config" if config_json is not None else args.model
    return ModelSpec(name=name, config_json=config_json, seq=args.seq, dtype=args.dtype)


def recorded_model(record: dict, where: str) -> ModelSpec | None:
    """The model a commit record names; None when it names none or a factory."""
    if "model" not in record:
        return None
    try:
        spec = ModelSpec.from_dict(record["model"])
    except (BadRecord, TypeError, ValueError) as e:
        raise ExportInputError(f"{where}: its record of the model is not one ({str(e)[:200]})") from None
    if ":" in spec.name and not spec.name.startswith("hf:"):
        return None  # a factory: imported only when the user names it
    if spec.dtype not in DTYPES:
        raise ExportInputError(f"{where}: its record of the model names dtype {spec.dtype[:40]!r}")
    return spec


def find(storage, args) -> tuple[Attempt, dict[int, str], ModelSpec, ModelSource]:
    """(attempt, layer -> hash, model, its source) of the checkpoint to export: the
    newest committed attempt (or the newest taken before --iteration) whose commit
    names every layer of its model. Its files are read later, one at a time."""
    given = given_model(args)
    attempts = [a for a in committed(storage) if args.iteration is None or a.iteration == args.iteration]
    for attempt in attempts:
        where = f"{args.checkpoint}: {attempt.folder}"
        record = commit_record(storage, attempt) or {}
        spec = given or recorded_model(record, where)
        if spec is None:
            raise ExportInputError(f"{where} does not name its model (written by an older bamboo, or a factory "
                                   f"model): give --model or --model-config, with --seq and --dtype as trained")
        try:
            source = ModelSource.of(spec)
        except ValueError as e:
            raise ExportInputError(str(e)) from None
        hashes = commit_hashes(record)
        if hashes is None:
            continue  # not a commit record: an older attempt may be whole
        if sorted(hashes) != list(range(source.count)):
            raise ExportInputError(f"{where} holds {len(hashes)} layers, model {spec.name} has {source.count}: "
                                   f"give the model it was trained with")
        return attempt, hashes, spec, source
    which = f"taken before iteration {args.iteration}" if args.iteration is not None else "at all"
    raise ExportInputError(f"{args.checkpoint}: no complete checkpoint {which}")


def matching(source: ModelSource, spec: ModelSpec, index: int, params: dict) -> dict:
    """`params` if they are layer `index` of the model (names and shapes), else the
    one-line error: another model of as many layers would export as garbage."""
    import torch
    with torch.device("meta"):  # shapes only: no memory for a large model's layer
        layer = source.hf.build(index) if source.hf is not None else source.layer(index)
    want = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in params.items() if torch.is_tensor(v)}
    if got != want:
        odd = sorted(set(got) ^ set(want)) or [k for k in sorted(want) if got[k] != want[k]]
        raise ExportInputError(f"layer {index} of the checkpoint is not model {spec.name}'s ({odd[0]} differs): "
                               f"give the model it was trained with")
    kinds = {v.dtype for v in params.values() if torch.is_tensor(v) and v.is_floating_point()}
    if kinds - {spec.torch_dtype}:
        raise ExportInputError(f"layer {index} of the checkpoint holds {', '.join(sorted(map(str, kinds)))} "
                               f"weights, not --dtype {spec.dtype}'s: give the dtype it was trained with")
    return params


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bamboo.model.export import ExportError, check_target, export_states
    try:
        check_target(args.out, "OUT")
        storage = storage_for(args.checkpoint)
        attempt, hashes, spec, source = find(storage, args)
        export_states(lambda i: matching(source, spec, i, loaded(read_layer(storage, attempt, i, hashes[i]))["params"]),
                      args.out, source)
    except (ExportInputError, ExportError, CheckpointError, OSError) as e:
        print(f"bamboo-export: error: {e}", file=sys.stderr)
        return 2
    except KeyError as e:  # a layer file named by the commit is gone
        print(f"bamboo-export: error: {args.checkpoint}: {e.args[0] if e.args else e}: missing", file=sys.stderr)
        return 2
    except ValueError as e:  # objects.ObjectError: the bucket or the prefix cannot be read
        print(f"bamboo-export: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"bamboo-export: {args.out}: model {spec.name}, {source.count} layers, from the checkpoint taken before "
          f"iteration {attempt.iteration} in {args.checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
