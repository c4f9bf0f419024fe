"""Type stubs of flashrt's native module (the Rust runtime through PyO3)."""

from os import PathLike
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

_Path = Union[str, "PathLike[str]"]
_Tokens = Union[str, Sequence[int]]

class Error(Exception):
    """A flashrt runtime error (its message is the runtime's)."""

class CapsuleTypeError(TypeError):
    """A capsule of another model (another fingerprint) was given to a session."""

class Token:
    """One generated token."""

    id: int
    text: str
    """The text this token made visible (whole characters; may be empty)."""

class Generation(Iterator[Token]):
    """Tokens as they are chosen; each one's decode step runs when the next is asked for
    (or before the session's next use)."""

    @property
    def session(self) -> Session: ...
    @property
    def reused(self) -> int:
        """For `Model.chat` with a session: prompt tokens already in it."""
    def text(self) -> str:
        """Run to the end: the text of every token not yet yielded."""
    def __iter__(self) -> Generation: ...
    def __next__(self) -> Token: ...

class Capsule:
    """A session's whole execution state at a token boundary."""

    @property
    def pos(self) -> int: ...
    @property
    def tokens(self) -> list[int]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def location(self) -> str:
        """Where its bytes live: "host", "cuda:0", ..."""
    def region(self, name: str) -> bytes: ...
    def save(self, path: _Path) -> int:
        """Write a standalone capsule file (atomic, checksummed); returns its size."""

class Session:
    """One session's state on the backend. Safe to share between threads: calls take turns."""

    @property
    def pos(self) -> int: ...
    @property
    def tokens(self) -> list[int]: ...
    @property
    def model(self) -> Model: ...
    def append(self, tokens: _Tokens) -> None:
        """Feed token ids, or text through the model's tokenizer."""
    def step(self, token: int) -> None:
        """Feed one token: one decode step."""
    def set_sampler(
        self,
        *,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        seed: Optional[int] = None,
    ) -> None:
        """The sampler `sample` and `generate` use (unset: the checkpoint's defaults)."""
    def sample(self) -> int:
        """The next token from the last logits (the session's sampler), not fed."""
    def decode_greedy(self, n: int) -> list[int]: ...
    def logits(self) -> Any:
        """The last logits row: a float32 numpy array (array.array("f") without numpy)."""
    def generate(
        self,
        max_tokens: int = 16,
        *,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        seed: Optional[int] = None,
        stop: Optional[Sequence[str]] = None,
        stop_ids: Optional[Sequence[int]] = None,
        ignore_eos: bool = False,
    ) -> Generation: ...
    def snapshot(self) -> Capsule: ...
    def restore(self, capsule: Capsule) -> None: ...
    def rows_held(self, capsule: Capsule) -> int:
        """K/V rows of `capsule` this session holds already (a restore of it skips them)."""
    def rollback(self, capsule: Capsule) -> None: ...
    def restore_kv_only(self, capsule: Capsule) -> None:
        """The KV-only ablation (attention K/V only): the continuation diverges."""
    def reset(self) -> None: ...
    def read_region(self, name: str) -> bytes: ...
    def synchronize(self) -> None: ...

class Model:
    """A model with its weights on a backend."""

    def __init__(
        self,
        path: _Path,
        *,
        backend: str = "auto",
        random_weights: bool = False,
        seed: int = 0,
        checkpoint: Optional[_Path] = None,
        max_seq: Optional[int] = None,
        buckets: Optional[Sequence[int]] = None,
        dtype: Optional[str] = None,
        tokenizer: Optional[_Path] = None,
        quantize: Optional[str] = None,
        decode_matmuls: Optional[str] = None,
    ) -> None:
        """`decode_matmuls`: "cuda-cores" (default) or "tensor-cores" (several streams stepped
        together cost little more than one); the CPU ignores it."""
    @property
    def name(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def vocab(self) -> int: ...
    @property
    def max_seq(self) -> int: ...
    @property
    def backend(self) -> str: ...
    @property
    def has_tokenizer(self) -> bool: ...
    @property
    def has_chat_template(self) -> bool: ...
    @property
    def eos(self) -> list[int]: ...
    @property
    def state_regions(self) -> list[str]: ...
    def calibrate_chunking(self, runs: int = 3) -> list[tuple[str, float, float]]:
        """Time every decode, verify and prefill plan and make appends choose their steps
        by the measurements (worth it on a GPU); returns (plan, ms per step, ms per row)."""
    def chunk_plan(self, n: int) -> list[tuple[str, int]]:
        """The steps an append of `n` tokens runs: (plan, rows) in order."""
    def session(self) -> Session: ...
    def step_batch(self, sessions: Sequence[Session], tokens: Sequence[int]) -> None:
        """One decode step for several sessions at once (`sessions[i]` feeds `tokens[i]` at its
        own position), each ending exactly as after its own `step`; on a GPU up to 8 run as one
        step that reads the weights once."""
    def fork(self, capsule: Capsule) -> Session: ...
    def load_capsule(self, path: _Path) -> Capsule: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...
    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str: ...
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        *,
        session: Optional[Session] = None,
        max_tokens: int = 256,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        min_p: Optional[float] = None,
        seed: Optional[int] = None,
        stop: Optional[Sequence[str]] = None,
        ignore_eos: bool = False,
        template_kwargs: Optional[Mapping[str, Any]] = None,
    ) -> Generation: ...

def _rust_decode_steps(session: Session, tokens: Sequence[int], n: int) -> float: ...
def _rust_restore_to_first_token(
    session: Session, capsule: Capsule, tokens: Sequence[int], iters: int
) -> list[float]: ...
