"""`python -m hpctrain export-hf RUN_DIR OUT [checkpoint=DIR]`: a run's checkpoint as a transformers model directory.

OUT gets config.json, the weights as safetensors files of at most `SHARD_BYTES` with their index (the layout the
hub uses), and the tokenizer the run's shards were made with — or, for a run started from a transformers directory
(model.init_from=hf:DIR), that directory's tokenizer files, chat template, generation_config.json and special-token
ids — so that `AutoModelForCausalLM.from_pretrained(OUT)`
and `AutoTokenizer.from_pretrained(OUT)` load it. The checkpoint is read one output file at a time, whatever
layout wrote it: memory stays one file's worth, never the whole model. OUT is written under a temporary name and
renamed when complete; an existing OUT is refused, never overwritten.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch

from hpctrain.core.config import ModelConfig, RopeType

SHARD_BYTES = 2 * 10**9
USAGE = ("usage: python -m hpctrain export-hf RUN_DIR OUT [checkpoint=DIR]\nwrites the run's latest checkpoint "
         "(or checkpoint=DIR) as a transformers model directory OUT (config.json, safetensors, tokenizer)")


class ExportError(ValueError):
    """Bad arguments, an unusable run directory or an occupied OUT: one line naming the fix."""


def _groups(shapes: dict[str, tuple[torch.Size, torch.dtype]], limit: int) -> list[list[str]]:
    """Consecutive tensors packed into files of at most `limit` bytes (a larger tensor gets a file of its own)."""
    groups, size = [[]], 0
    for key, (shape, dtype) in shapes.items():
        nbytes = shape.numel() * dtype.itemsize
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups


def export(model_cfg: ModelConfig, data_path: str, ckpt: str, out: str, shard_bytes: int | None = None) -> str:
    """Write checkpoint `ckpt` of a run (its `model` group, its data.path for the tokenizer) to `out` as a
    transformers directory; returns `out`."""
    from hpctrain.models import spec_of
    from hpctrain.storage import checkpoint

    if os.path.lexists(out):
        raise ExportError(f"{out} exists: choose a new OUT (nothing is ever overwritten or removed)")
    spec = spec_of(model_cfg)
    weights = spec.weights(spec.args(model_cfg))
    checkpoint.check_model(ckpt, weights)  # exactly this model's weights, before OUT is made
    _check_nothing_dropped(spec, spec.args(model_cfg), weights, ckpt)
    data = os.path.expanduser(str(data_path))
    manifest = _manifest(data)
    if manifest is not None:  # (the shards rebuilt since with another tokenizer would give OUT the wrong one)
        checkpoint.check_tokenizer(ckpt, data, manifest.tokenizer.sha256)
    tmp = f"{out.rstrip(os.sep)}.partial-{os.getpid()}"
    try:
        os.makedirs(tmp)
    except OSError as e:
        raise ExportError(f"cannot create {out} ({e.strerror}: {e.filename}): choose an OUT in a directory you can "
                          "write to") from None
    try:  # whatever stops the export (an error, Ctrl-C), the partial directory this call made goes
        _write(model_cfg, data, manifest, ckpt, tmp, weights, shard_bytes or SHARD_BYTES)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_nothing_dropped(spec, args, weights: dict, ckpt: str) -> None:
    """A tensor of ours that the family's transformers class has no place for must be what that class assumes (zero):
    MoE's routing bias (model.moe.bias_update_rate) chooses the experts, and the export would choose others."""
    from hpctrain.storage import checkpoint

    names = spec.hf().disk_names(args)
    extra = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in weights.items() if k not in names}
    if extra:
        checkpoint.read_weights(ckpt, extra)
    held = sorted(k for k, t in extra.items() if t.any())
    if held:
        raise ExportError(f"{ckpt} holds {held[0]}{f' (and {len(held) - 1} more)' if len(held) > 1 else ''}, which "
                          f"transformers' {spec.hf().model_class} has no place for (a routing bias: "
                          "model.moe.bias_update_rate): the export would route tokens to other experts than this "
                          "model does, so it is not written")


def _write(model_cfg: ModelConfig, data: str, manifest, ckpt: str, tmp: str, weights: dict, shard_bytes: int) -> None:
    """The weights file by file, their index, the tokenizer (the run's shards in `data`: their `manifest`, None when
    unreadable) and config.json into the new directory `tmp`."""
    from safetensors.torch import save_file

    from hpctrain.core.files import fsync_dir, write_json
    from hpctrain.models import spec_of
    from hpctrain.storage import checkpoint

    spec = spec_of(model_cfg)
    args = spec.args(model_cfg)
    names = spec.hf().disk_names(args)
    shapes = {k: (torch.Size(shape), dtype) for k, (shape, dtype) in weights.items()
              if k in names and not (args.tie_embeddings and k == "output.weight")}  # a tied head is the embedding
    groups = _groups(shapes, shard_bytes)
    weight_map, total = {}, 0
    for i, keys in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: torch.empty(shapes[k][0], dtype=shapes[k][1]) for k in keys}
        checkpoint.read_weights(ckpt, tensors)
        # (a tensor saved row by row, an MoE layer's experts: each row a tensor of its own)
        out = {name: t if len(names[k]) == 1 else t[i].contiguous() for k, t in tensors.items()
               for i, name in enumerate(names[k])}
        save_file(out, os.path.join(tmp, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, file))
        total += sum(t.nbytes for t in tensors.values())
    write_json(os.path.join(tmp, "model.safetensors.index.json"),
               {"metadata": {"total_size": total}, "weight_map": weight_map})
    origin = _origin(model_cfg)
    # the model the run started from: its tokenizer, chat template, generation settings, token ids and context
    ids = _carry_over(origin, tmp, args) if origin else {}
    if not any(os.path.exists(os.path.join(tmp, name)) for name in TOKENIZER_FILES):  # (an origin of weights alone)
        eos = _copy_tokenizer(data, manifest, tmp)
        # (no tokenizer: no token ids either, rather than transformers' defaults, which are not this vocabulary's)
        ids = ids or {"bos_token_id": eos, "eos_token_id": eos}
    spec.hf().to_hf_config(args, torch_dtype="float32", **ids).save_pretrained(tmp)
    _write_legacy_rope(os.path.join(tmp, "config.json"))
    fsync_dir(tmp)


def _write_legacy_rope(config_json: str) -> None:
    """config.json's RoPE also as transformers 4 wrote it (`rope_theta`, `rope_scaling`): a reader that knows only
    those keys (a serving stack pinned to transformers 4) would otherwise take the default theta and no scaling,
    silently; transformers 5 reads either form."""
    from hpctrain.core.files import read_json, write_json

    config = read_json(config_json)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        write_json(config_json, config)


# What a published model directory holds besides its weights and config.json: an export of a run started from it
# carries these over, so that the fine-tuned model tokenizes, chats and generates as the original did.
CARRIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
           "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
           "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # what AutoTokenizer builds one from
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
CARRIED_BYTES = 64 * 2**20  # a tokenizer.json of a 256k vocabulary is ~30 MB


def _origin(model_cfg: ModelConfig) -> str | None:
    """The transformers directory the run started from (model.init_from=hf:DIR), while it is still there."""
    from hpctrain.models import init_source

    init = init_source(model_cfg)
    return init[1] if init and init[0] and os.path.isfile(os.path.join(init[1], "config.json")) else None


def _carry_over(origin: str, dest: str, args=None) -> dict:
    """Copy CARRIED files of `origin` (regular files of sane size; symlinks of a hub cache followed) into `dest`;
    return its config.json's special-token ids, and its max_position_embeddings where the run trained at a shorter
    model.max_seq_len (lowered to save memory: the model's context is still the original's)."""
    from hpctrain.core.files import FileCheckError, read_bytes, read_json

    try:
        for name in CARRIED:
            src = os.path.join(origin, name)
            if os.path.lexists(src):
                data = read_bytes(src, CARRIED_BYTES)
                with open(os.path.join(dest, name), "wb") as f:
                    f.write(data)
        config = read_json(os.path.join(origin, "config.json"))
    except (FileCheckError, ValueError) as e:
        raise ExportError(f"cannot carry {origin}'s tokenizer and settings over: {' '.join(str(e).split())}") from None
    config = config if isinstance(config, dict) else {}
    out = {k: config[k] for k in SPECIAL_IDS if config.get(k) is not None}
    context = config.get("max_position_embeddings")
    if args and type(context) is int and context > args.max_seq_len and args.rope_scaling.type != RopeType.dynamic:
        out["max_position_embeddings"] = context  # (dynamic NTK's is where its growth starts: the config's own)
    return out


def _manifest(data: str):
    """The manifest of the run's shards in `data`; None, with a warning, where they cannot be read (the weights are
    still worth exporting)."""
    from hpctrain.core.errors import say
    from hpctrain.core.shard_format import read_manifest

    try:
        return read_manifest(data)
    except Exception as e:  # noqa: BLE001 - the data may be gone, or moved
        say(f"warning: the run's shards (data.path={data}) cannot be read ({' '.join(str(e).split())[:200]}): "
            "the export has no tokenizer and no token ids unless the run started from a transformers directory")
        return None


def _copy_tokenizer(data: str, manifest, dest: str) -> int | None:
    """The tokenizer the run's shards (in `data`) name, copied beside the weights; returns its EOS id (None without
    shards)."""
    if manifest is None:
        return None
    tok_dir = os.path.dirname(os.path.join(data, manifest.tokenizer.path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.isfile(os.path.join(tok_dir, name)):
            shutil.copyfile(os.path.join(tok_dir, name), os.path.join(dest, name))
    return manifest.eos_id


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    from hpctrain.core.command import run_command
    from hpctrain.core.errors import CheckpointError
    from hpctrain.runs.rundir import RunDirError, run_config
    from hpctrain.storage import checkpoint

    positional = [a for a in argv if "=" not in a]
    options = dict(a.split("=", 1) for a in argv if "=" in a)

    def work() -> None:
        if len(positional) != 2 or set(options) - {"checkpoint"}:
            raise ExportError(f"expected RUN_DIR OUT [checkpoint=DIR], got {' '.join(argv) or 'nothing'}")
        cfg, ckpt = run_config(positional[0], options.get("checkpoint"))
        with checkpoint.as_tool_says():
            print(f"exported {ckpt} to {export(cfg.model, cfg.data.path, ckpt, positional[1])}")

    # A disk that filled, a directory that vanished: nothing of OUT is left (see export).
    return run_command(work, "hpctrain export-hf", (ExportError, RunDirError, CheckpointError),
                       os_error=lambda e: f"writing {positional[1]} failed ({e.strerror}: {e.filename}): free space or "
                                          "choose another OUT", interrupted="interrupted (nothing of OUT was left)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
