"""Publishing the trained drafter's weights into an inference copy, in place.

The inference copy (SGLang's draft runner) may fuse parameters (q/k/v -> qkv_proj, gate/up ->
gate_up_proj), shard them over tensor-parallel ranks, and have its storage baked into captured
CUDA graphs. So publishing never rebinds a tensor: each destination is written with
`dst.copy_(...)` (casting dtype and device), and its data_ptr never changes. `read` is the inverse
(the inference copy's values back into tensors shaped as the trained weights, unsharded only): how
TTS re-reads a retrained drafter that SGLang loaded into its draft model (sglang/weight_sync.py).

A ParamBinding says how one destination is assembled from trained tensors:

    dst = cat([shard(trained[s]) for s in sources], cat_dim)

where shard(t), if a ShardSpec (dim, rank, world_size) is given, is the rank's contiguous
1/world_size slice of t along dim. Slicing each source *before* concatenation is how SGLang's
QKVParallelLinear / MergedColumnParallelLinear shard q, k, v (and gate, up) separately; for a
single source it is the plain TP slice of the full tensor. (KV heads replicated over more TP ranks
than there are KV heads are not supported: every sharded size must divide by world_size.)

Serving does not shard yet: the workers bind with no ShardSpec (sglang/binding.py), and
`--speculative-algorithm TTS` refuses --tp-size > 1 at launch (sglang/algorithm.py). ShardSpec is
the slicing a tensor-parallel publisher would use, tested on CPU only (tests/core/test_publish.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch


class PublishError(ValueError):
    """A binding that cannot be satisfied (missing source, shape mismatch); raised at bind time."""


@dataclass(frozen=True)
class ShardSpec:
    """Rank `rank`'s contiguous 1/world_size slice along `dim`. Not used by serving (TP > 1 is refused)."""

    dim: int
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise PublishError(f"bad shard rank {self.rank} of world size {self.world_size}")

    def slice(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.shape[self.dim]
        if size % self.world_size:
            raise PublishError(f"dim {self.dim} of size {size} does not split over {self.world_size} ranks")
        chunk = size // self.world_size
        return tensor.narrow(self.dim, self.rank * chunk, chunk)


@dataclass
class ParamBinding:
    dst: torch.Tensor
    sources: list[str]
    cat_dim: int = 0
    shard: ShardSpec | None = None
    name: str = ""  # the destination's name, for error messages

    def parts(self, trained: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The (sharded) source tensors, in concatenation order."""
        missing = [s for s in self.sources if s not in trained]
        if missing:
            raise PublishError(f"{self.name or 'binding'}: trained weights lack {missing}")
        tensors = [trained[s] for s in self.sources]
        return [self.shard.slice(t) for t in tensors] if self.shard is not None else tensors

    def check(self, trained: Mapping[str, torch.Tensor | Sequence[int]]) -> None:
        """Raise PublishError unless the sources assemble exactly into dst's shape."""
        as_meta = {s: _meta(trained[s]) for s in self.sources if s in trained}
        parts = self.parts(as_meta)
        try:
            shape = torch.cat(parts, self.cat_dim).shape
        except RuntimeError as exc:
            raise PublishError(f"{self.name or 'binding'}: sources {self.sources} do not concatenate: {exc}") from exc
        if shape != self.dst.shape:
            raise PublishError(
                f"{self.name or 'binding'}: sources {self.sources} give shape {tuple(shape)}, "
                f"destination is {tuple(self.dst.shape)}"
            )

    @torch.no_grad()
    def write(self, trained: Mapping[str, torch.Tensor]) -> None:
        # Copy each part into its slice of dst: no temporary concatenation, and dst is never rebound.
        offset = 0
        for part in self.parts(trained):
            width = part.shape[self.cat_dim]
            self.dst.data.narrow(self.cat_dim, offset, width).copy_(part)
            offset += width

    @torch.no_grad()
    def read(self, out: Mapping[str, torch.Tensor]) -> None:
        """The inverse of write: copy dst's slices into the source tensors `out[s]` (shaped as the
        trained weights), in place, casting. A sharded destination holds one rank's slice only."""
        if self.shard is not None:
            raise PublishError(f"{self.name or 'binding'}: a sharded destination cannot be read back")
        missing = [s for s in self.sources if s not in out]
        if missing:
            raise PublishError(f"{self.name or 'binding'}: nothing to read {missing} into")
        offset = 0
        for source in self.sources:
            part = out[source]
            width = part.shape[self.cat_dim]
            part.copy_(self.dst.detach().narrow(self.cat_dim, offset, width))
            offset += width


def _meta(x: torch.Tensor | Sequence[int]) -> torch.Tensor:
    shape = x.shape if isinstance(x, torch.Tensor) else tuple(x)
    return torch.empty(shape, device="meta")


@dataclass
class WeightPublisher:
    """Writes trained weights into bound inference tensors; validated once, at construction."""

    bindings: list[ParamBinding]
    # Shapes (or tensors) of the trained weights; when given, every binding is checked now.
    source_shapes: Mapping[str, torch.Tensor | Sequence[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.source_shapes is not None:
            for binding in self.bindings:
                binding.check(self.source_shapes)
            self.source_shapes = None  # do not keep references to the trained tensors

    def publish(self, named_params: Mapping[str, torch.Tensor]) -> None:
        for binding in self.bindings:
            binding.write(named_params)

    def restricted_to(self, names: Iterable[str]) -> WeightPublisher:
        """The bindings that read at least one of `names` (what an update that trains only those changes).
        A fused destination keeps all its sources: its untrained parts are rewritten with their values."""
        wanted = set(names)
        return WeightPublisher([b for b in self.bindings if wanted.intersection(b.sources)])

    def read(self, out: Mapping[str, torch.Tensor]) -> None:
        """The inverse of publish: the bound inference tensors' current values into `out` (by trained
        name, every bound name present), e.g. a retrained drafter an engine loaded itself."""
        for binding in self.bindings:
            binding.read(out)

    @classmethod
    def from_name_map(
        cls,
        serving: Mapping[str, torch.Tensor],
        trained: Mapping[str, torch.Tensor],
        name_map: Mapping[str, str | Sequence[str]] | None = None,
        shards: Mapping[str, ShardSpec] | None = None,
        cat_dims: Mapping[str, int] | None = None,
    ) -> WeightPublisher:
        """Bind serving tensors by name: name_map[dst] = source name(s); None = same names.

        With name_map None, every serving name that the trained weights also have is bound.
        """
        if name_map is None:
            name_map = {name: name for name in serving if name in trained}
            if not name_map:
                raise PublishError("no serving tensor name matches a trained weight name")
        shards = shards or {}
        cat_dims = cat_dims or {}
        bindings = []
        for dst_name, sources in name_map.items():
            if dst_name not in serving:
                raise PublishError(f"no serving tensor named {dst_name!r}")
            source_list = [sources] if isinstance(sources, str) else list(sources)
            bindings.append(
                ParamBinding(serving[dst_name], source_list, cat_dims.get(dst_name, 0), shards.get(dst_name), dst_name)
            )
        return cls(bindings, source_shapes=trained)


# SGLang's fused linear layers and the separate projections they stack, in order.
STACKED_PARAMS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def stacked_name_map(
    serving_names: Iterable[str], trained_names: Iterable[str], stacked: Mapping[str, Sequence[str]] = STACKED_PARAMS
) -> dict[str, list[str]]:
    """Map serving names to trained names, unstacking fused projections (e.g. ...qkv_proj.weight ->
    ...q_proj.weight, ...k_proj.weight, ...v_proj.weight). Serving names with no match are left out."""
    trained = set(trained_names)
    name_map: dict[str, list[str]] = {}
    for name in serving_names:
        if name in trained:
            name_map[name] = [name]
            continue
        for fused, parts in stacked.items():
            if f".{fused}." in f".{name}":
                candidates = [name.replace(fused, part) for part in parts]
                if all(c in trained for c in candidates):
                    name_map[name] = candidates
                break
    return name_map
