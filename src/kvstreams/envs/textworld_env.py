"""TextWorld: real text games, generated offline with the ``textworld`` package.

Côté et al., 2018, "TextWorld: A Learning Environment for Text-based Games"; the KV-streams paper's
main agentic benchmark. Games are made with ``textworld.make`` (what ``tw-make custom`` runs; the
Inform 7 compiler ships inside the wheel), seeded, into a cache directory, so the same seed is the
same game. Observations are user messages; the agent replies ``<action>command</action>``. A reply
without a parsable action is sent as it is (the game answers "That's not a verb I recognise."),
reduced to printable ASCII (the Z-machine's jericho crashes on anything else); nothing the agent
says crashes an episode. Reward: score gained / max score at every step.

Knobs: ``world_size`` (rooms), ``nb_objects``, ``quest_length``, ``max_turns`` (step limit),
``game_set`` (train on a fixed set of that many games; evaluation always plays unseen ones).
``expert_reply`` follows the game's walkthrough.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvstreams.atomic import sha256
from kvstreams.envs.base import Environment, Message, StepResult, parse_action, register
from kvstreams.errors import KVStreamsError

_STATUS = re.compile(r"\n?>\s*-= .*? =-\s*\d+/\d+\s*$", re.DOTALL)
_MAKE_LOCK = threading.Lock()


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVSTREAMS_CACHE", Path.home() / ".cache" / "kvstreams")) / "textworld"


def clean_observation(text: str) -> str:
    """Drop the engine's status line and the start banner; squeeze blank lines."""
    text = _STATUS.sub("", text)
    lines = text.splitlines()
    art = [i for i, line in enumerate(lines) if "$$" in line]  # the "TEXTWORLD" ASCII-art banner
    if art:
        text = "\n".join(lines[art[-1] + 1 :])
    text = re.sub(r"\n\s*\n+", "\n", text).strip()
    return text.rstrip(">").strip()


def game_command(reply: str) -> str:
    """The command for the game: the reply's action, else the reply itself, in printable ASCII.

    The Z-machine reads ZSCII; jericho crashes the process on control or non-ASCII bytes (which an
    untrained model writes freely) and dumb-frotz treats a backslash as its own escape.
    """
    command = parse_action(reply)
    command = reply if command is None else command
    command = re.sub(r"[^A-Za-z0-9 .,'!?-]+", " ", command)  # no control bytes, no frotz escapes (\\)
    return " ".join(command.split())[:190]  # jericho truncates (with a warning) past 197 bytes


def write_game_digests(story: Path) -> None:
    """Record the sha256 of a generated game's story and metadata files beside them."""
    files = [story, story.with_suffix(".json")]
    story.with_suffix(".sha256").write_text(json.dumps({f.name: sha256(f) for f in files}))


def cached_game_problem(story: Path) -> str | None:
    """Why a cached game cannot be trusted, or None: its recorded digests, or, for games cached
    before digests were written, the Z-machine header (version 8, the file at least as long as the
    length it declares) and the metadata parsing as JSON."""
    digests = story.with_suffix(".sha256")
    if digests.is_file():
        try:
            expected = json.loads(digests.read_text())
        except ValueError:
            return "unreadable digests"
        for name, digest in expected.items():
            f = story.parent / name
            if not f.is_file() or sha256(f) != digest:
                return f"{name} does not match its digest"
        return None
    data = story.read_bytes()
    declared = int.from_bytes(data[0x1A:0x1C], "big") * 8 if len(data) >= 0x40 else 0
    if len(data) < 0x40 or data[0] != 8 or declared == 0 or declared > len(data):
        return f"{story.name} is not a complete Z-machine version 8 story"
    try:
        json.loads(story.with_suffix(".json").read_text())
    except (ValueError, UnicodeDecodeError):
        return f"{story.with_suffix('.json').name} is not JSON"
    return None


@register("textworld")
@dataclass
class TextWorldEnv(Environment):
    token_budget: ClassVar[int] = 1024

    world_size: int = 3
    nb_objects: int = 6
    quest_length: int = 3
    max_turns: int = 24
    cache_dir: str = ""
    game_set: int = 0
    _env: Any = field(default=None, init=False, repr=False)
    _walkthrough: list[str] = field(default_factory=list, init=False, repr=False)
    _max_score: float = field(default=1.0, init=False, repr=False)
    _score: float = field(default=0.0, init=False, repr=False)
    _steps: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.require_at_least(world_size=1, nb_objects=1, quest_length=1, max_turns=1, game_set=0)

    def game_seed(self, seed: int) -> int:
        """The game an episode seed plays: with ``game_set = N`` training cycles over N games
        (seeds 0..N-1), otherwise every seed is its own game."""
        return seed % self.game_set if self.game_set else seed

    def held_out(self) -> TextWorldEnv:
        """Evaluation plays the game of its own seed (evaluation seeds start at ``train.eval_seed``,
        far above any training game), never one of the training set."""
        return dataclasses.replace(self, game_set=0)

    def game_path(self, seed: int) -> Path:
        root = Path(self.cache_dir) if self.cache_dir else default_cache_dir()
        name = f"w{self.world_size}-o{self.nb_objects}-q{self.quest_length}-s{seed}.z8"
        return root / name

    def make_game(self, seed: int) -> Path:
        """Generate the game for ``seed`` unless it is cached (about 1-2 s per game). A cached game that
        fails its check (:func:`cached_game_problem`) is never loaded: it is generated again, and the
        message names it (jericho could end the process on a corrupt story file)."""
        path = self.game_path(seed)
        if path.is_file() and path.with_suffix(".json").is_file():
            problem = cached_game_problem(path)
            if problem is None:
                return path
            print(
                f"kvstreams: cached TextWorld game {path} is corrupt ({problem}); generating it again",
                file=sys.stderr,
            )
        try:
            import textworld
        except ImportError:
            raise KVStreamsError(
                "the textworld environment needs the `textworld` package (pip install textworld)"
            ) from None
        path.parent.mkdir(parents=True, exist_ok=True)
        options = textworld.GameOptions()
        options.seeds = seed
        options.nb_rooms = self.world_size
        options.nb_objects = self.nb_objects
        options.quest_length = self.quest_length
        options.path = str(path)
        options.force_recompile = True
        with _MAKE_LOCK:
            home = os.environ.get("HOME")
            os.environ["HOME"] = str(
                path.parent
            )  # the Inform 7 compiler writes ~/Inform; keep it in the cache
            try:
                textworld.make(options)
            finally:
                if home is None:
                    os.environ.pop("HOME", None)
                else:
                    os.environ["HOME"] = home
        write_game_digests(path)
        return path

    def reset(self, seed: int) -> list[Message]:
        import textworld

        self.close()
        path = self.make_game(self.game_seed(seed))
        infos = textworld.EnvInfos(max_score=True, won=True, lost=True, extras=["walkthrough"])
        with (
            warnings.catch_warnings()
        ):  # jericho: "not fully supported" (it scores through textworld instead)
            warnings.simplefilter("ignore")
            self._env = textworld.start(str(path), request_infos=infos)
            state = self._env.reset()
        self._walkthrough = list(state.get("extra.walkthrough") or [])
        self._max_score = float(state.get("max_score") or 1.0)
        self._score = 0.0
        self._steps = 0
        return [
            {
                "role": "system",
                "content": "You play a text adventure. Reply with <action>a command</action>, "
                "e.g. <action>go north</action> or <action>take key</action>.",
            },
            {"role": "user", "content": clean_observation(state.feedback)},
        ]

    def step(self, reply: str) -> StepResult:
        if self._env is None:
            raise RuntimeError("step() before reset()")
        state, score, done = self._env.step(game_command(reply))
        self._steps += 1
        reward = (float(score) - self._score) / self._max_score
        self._score = float(score)
        info = {"score": self._score, "max_score": self._max_score, "won": bool(state.get("won"))}
        if done:
            return StepResult([], reward, True, info)
        return StepResult(
            [{"role": "user", "content": clean_observation(state.feedback) or "Nothing happens."}],
            reward,
            False,
            info,
        )

    def expert_reply(self) -> str:
        if self._steps < len(self._walkthrough):
            return f"<action>{self._walkthrough[self._steps]}</action>"
        return "<action>look</action>"

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
