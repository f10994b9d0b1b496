"""Which target layers a draft reads (its aux layers), in one convention, with one check.

eyas' aux id k is the INPUT of target decoder layer k: transformers' `hidden_states[k]` (0 is the
embeddings, k = N the last layer's output before the final norm, which vLLM collects too). vLLM and
speculators read ids the same way. Other fields count from the layer OUTPUT (id j = the output of
decoder layer j = eyas' j + 1): SGLang adds 1 to the ids in `eagle_config`, and DFlash's
`target_layer_ids` name outputs in both engines. A draft trained for one convention and served under
the other reads every state one layer off and loses most of its acceptance, without an error.

So every id crosses a layout's boundary through `to_layout` / `from_layout` here, and every exported
config records, in its `eyas` block, the convention of the ids it wrote (`CONVENTION_KEY`) beside
eyas' own ids, which the reader (eyas.model.checkpoints) checks against each other.
"""

from __future__ import annotations

from typing import Any

from eyas.utils.io import EyasError

INPUT, OUTPUT = "input-of-layer", "output-of-layer"  # id k: the input of decoder layer k / its output
SHIFT = {INPUT: 0, OUTPUT: -1}  # a layout's id = eyas' id + SHIFT[convention]
CONVENTION_KEY = "aux_layer_convention"  # in an exported config's `eyas` block
# where each layout writes its ids, and in which convention
LAYOUT_IDS = {
    "vllm": ("eagle_aux_hidden_state_layer_ids", INPUT),
    "speculators": ("eagle_aux_hidden_state_layer_ids", INPUT),
    "sglang": ("eagle_config.eagle_aux_hidden_state_layer_ids", OUTPUT),
    "block": ("dflash_config.target_layer_ids", OUTPUT),  # the DFlash-style config of block drafts
}


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's rule, an early, a middle and a late layer: [2, N//2, N-3] (61 layers -> [2, 30, 58]).
    Below 7 layers the rule repeats a layer; there the first, middle and last layer past the embeddings
    are read instead, and below 3 layers the user names them."""
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    if num_layers >= 4:
        return [1, num_layers // 2, num_layers - 1]
    if num_layers == 3:
        return [0, 1, 2]
    raise EyasError(f"a target of {num_layers} decoder layer(s) has no three distinct layers for the default aux "
                    "layers: pass --aux-layers with the ids to read (0..N: the input of decoder layer k, N the last "
                    "layer's output)")


def check_aux_layer_ids(ids: list[int], num_layers: int, where: str = "aux layer ids", captured: bool = False
                       ) -> list[int]:
    """The one check: every id a decoder layer's input, or N for the last layer's output (0..N), distinct, in
    layer order (the engines hand a served draft its states in layer order, whatever the config's order).
    `captured`: ids the capture engines hook (extract, online training), which are layer inputs only (0..N-1;
    the last layer's output is the store's `final_hidden`)."""
    ids = [int(i) for i in ids]
    if not ids:
        raise EyasError(f"{where}: no aux layer ids: a draft reads at least one target layer")
    top = num_layers - 1 if captured else num_layers
    bad = [i for i in ids if not 0 <= i <= top]
    if bad:
        last = "" if captured else f", {num_layers} the last layer's output"
        raise EyasError(f"{where} {ids}: {bad} out of range for a target with {num_layers} decoder layers (valid: "
                        f"0..{top}; id k is the input of decoder layer k{last})")
    if len(set(ids)) != len(ids):
        raise EyasError(f"{where} {ids}: a layer read twice gives the draft the same state twice and the engines "
                        "collect it once: give distinct ids")
    if ids != sorted(ids):
        raise EyasError(f"{where} must be in layer order, got {ids}: serving engines give the draft the layers in "
                        f"that order, so write {','.join(map(str, sorted(ids)))}")
    return ids


def to_layout(ids: list[int], convention: str) -> list[int]:
    """eyas' ids -> the ids a field of `convention` holds."""
    return [int(i) + SHIFT[convention] for i in ids]


def from_layout(ids: list[int], convention: str) -> list[int]:
    """The ids a field of `convention` holds -> eyas' ids."""
    if convention not in SHIFT:
        raise EyasError(f"aux layer convention {convention!r} is not one eyas knows ({', '.join(SHIFT)})")
    return [int(i) - SHIFT[convention] for i in ids]


def check_recorded(layout_ids: list[int], convention: str, recorded: list[int], where: str) -> list[int]:
    """eyas' ids from a layout's field, checked against the eyas ids the exporter recorded beside them:
    a field edited or shifted by one after export is refused, never served or imported silently."""
    ids = from_layout(layout_ids, convention)
    if ids != [int(i) for i in recorded]:
        raise EyasError(f"{where}: the config's aux layer ids {list(layout_ids)} ({convention}) are eyas ids {ids}, "
                        f"but the export recorded {list(recorded)}: an id shifted by one serves a draft the wrong "
                        "layers. Export the draft again, or fix the ids")
    return ids


def stated_aux_layer_ids(c: dict[str, Any], layout: str, where: str) -> list[int] | None:
    """The aux ids a foreign config states, in eyas' convention, read from the field the layout's engine
    reads (None: it states none); checked against the ids eyas' export recorded beside them."""
    top = c.get("eagle_aux_hidden_state_layer_ids")
    nested = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    dflash = c.get("dflash_config") if isinstance(c.get("dflash_config"), dict) else {}
    outputs = dflash.get("target_layer_ids", c.get("target_layer_ids"))
    if top and (layout in ("vllm", "speculators", "block")):  # vLLM reads these first, DFlash's too
        field, convention = top, INPUT
    elif nested and layout == "vllm":  # vLLM reads eagle_config's ids as they are
        field, convention = nested, INPUT
    elif nested and layout in ("sglang", "eagle"):  # SGLang (and SpecForge, which trains for it) add 1
        field, convention = nested, OUTPUT
    elif outputs and layout == "block":
        field, convention = outputs, OUTPUT
    else:
        return None
    block = c.get("eyas") if isinstance(c.get("eyas"), dict) else {}
    if CONVENTION_KEY not in block:  # not written by eyas, or by an eyas that did not record it
        return from_layout(field, convention)
    if block[CONVENTION_KEY] != convention:
        raise EyasError(f"{where}: the export wrote its aux layer ids as {block[CONVENTION_KEY]}, but the engine of "
                        f"the {layout} layout reads this config's ids {list(field)} as {convention}: it would serve "
                        "the draft states one layer off. Export the draft again for this layout")
    return check_recorded(field, convention, block.get("aux_layer_ids") or [], where)
