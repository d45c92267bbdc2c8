"""Synthetic chat conversations about the plays, for training the embedded model to chat, think and call a tool.

Every answer is read off the text of a play (parse_play): who speaks first in an act, who speaks in a scene,
how many scenes an act has, who says a given line, a line of a given character. The assistant reasons from
the text in a short <think> block, then answers in character. Tool episodes declare FIND_LINE in the
system turn; the assistant calls it in the XML form, the tool hands back a real line of the play (find_line),
and the assistant quotes it. Some conversations turn thinking off (the template's empty block), a few run to
two questions. Conversations are message lists (OpenAI form) that the caller renders with the model's own
chat template; the same seed gives the same conversations.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from typing import Callable

from deltaserve.chat_template import compile_chat_template
from deltaserve.convert.templates import QWEN35
from deltaserve.errors import DeltaserveError

FIND_LINE = {"type": "function", "function": {
    "name": "find_line",
    "description": "Find a line that a character speaks in one of Shakespeare's plays.",
    "parameters": {"type": "object", "properties": {
        "play": {"type": "string", "description": "the play's title, e.g. Macbeth"},
        "character": {"type": "string", "description": "the speaker's name as the play gives it, e.g. Lady Macbeth"}},
        "required": ["play", "character"]}}}
SYSTEM = "You are a player in Shakespeare's company. Answer in character, from the text of the plays."

TITLES = {"alls_well_that_ends_well": "All's Well That Ends Well", "as_you_like_it": "As You Like It",
          "comedy_of_errors": "The Comedy of Errors", "henry_iv_part_1": "Henry IV, Part 1",
          "henry_iv_part_2": "Henry IV, Part 2", "henry_v": "Henry V", "henry_vi_part_1": "Henry VI, Part 1",
          "henry_vi_part_2": "Henry VI, Part 2", "henry_vi_part_3": "Henry VI, Part 3",
          "henry_viii": "Henry VIII", "john": "King John", "lear": "King Lear",
          "loves_labours_lost": "Love's Labour's Lost", "merchant_of_venice": "The Merchant of Venice",
          "merry_wives_of_windsor": "The Merry Wives of Windsor",
          "midsummer_nights_dream": "A Midsummer Night's Dream", "much_ado_about_nothing": "Much Ado About Nothing",
          "richard_ii": "Richard II", "richard_iii": "Richard III", "taming_of_the_shrew": "The Taming of the Shrew",
          "tempest": "The Tempest", "tragedy_of_titus_andronicus": "Titus Andronicus",
          "two_gentlemen_of_verona": "The Two Gentlemen of Verona", "winters_tale": "The Winter's Tale"}
ROMAN = ("I", "II", "III", "IV", "V", "VI", "VII", "VIII", "IX", "X", "XI", "XII", "XIII", "XIV", "XV")
NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")

# acts and scenes are numbered in roman or arabic figures; a heading is "Macb." or "MACBETH." or "THESEUS"
_ACT = re.compile(r"ACT ([IVX]+|\d+)\.?(?:\s.*)?")
_SCENE = re.compile(r"(?:SCENE|Scene) ([IVX]+|\d+)\.?(?:\s.*)?")
_HEADING = re.compile(r"([A-Z][A-Za-z' -]{1,30}?)\.(?:\s*\[.*)?|([A-Z][A-Z' -]{1,30})")
_SMALL_WORDS = ("and", "of", "for", "the")
_NOT_NAMES = {"ACT", "SCENE", "Scene", "PROLOGUE", "EPILOGUE", "Epilogue", "Prologue", "FINIS", "THE END", "All", "ALL",
              "Both", "BOTH"}


@dataclass(frozen=True)
class Speech:
    act: str  # roman numeral, as the text writes it
    scene: str
    speaker: str  # as a reader names them: "Lady Macbeth", "First Witch"
    lines: tuple[str, ...]  # verse lines, stage directions taken out


@dataclass(frozen=True)
class Play:
    name: str  # the text's file name: "romeo_and_juliet"
    title: str  # "Romeo and Juliet"
    speeches: tuple[Speech, ...]

    def speakers(self, min_speeches: int = 3) -> list[str]:
        """Characters with at least min_speeches speeches whose name the text uses outside their headings (an
        abbreviated heading such as "Ber." names nobody a reader would ask for), in order of first speech."""
        counts: dict[str, int] = {}
        for s in self.speeches:
            counts[s.speaker] = counts.get(s.speaker, 0) + 1
        words = {w for s in self.speeches for line in s.lines for w in re.findall(r"[a-z']+", line.lower())}
        return [name for name, n in counts.items()
                if n >= min_speeches and len(name) >= 4 and name.split()[-1].lower() in words]

    def scenes(self) -> dict[tuple[str, str], list[Speech]]:
        """(act, scene) -> its speeches, in the play's order."""
        found: dict[tuple[str, str], list[Speech]] = {}
        for s in self.speeches:
            found.setdefault((s.act, s.scene), []).append(s)
        return found


def title_of(name: str) -> str:
    return TITLES.get(name) or " ".join(w if w in _SMALL_WORDS else w.capitalize() for w in name.split("_"))


def speaker_name(heading: str) -> str:
    """"LADY MACBETH" -> "Lady Macbeth"; mixed-case headings stay as written."""
    return " ".join(w.lower() if w.lower() in _SMALL_WORDS else w.capitalize() if w.isupper() else w
                    for w in heading.split())


def parse_play(name: str, text: str) -> Play | None:
    """The speeches of a play text (as train.read_texts gives it), or None for a text with no acts (a poem).
    A speech is a heading line ("MACBETH." or "Macb. [Aside.]") after a blank line, then its lines up to the
    next blank line; lines holding a bracketed stage direction are dropped, so every line is verbatim."""
    act = scene = None
    speeches = []
    blocks = [block.split("\n") for block in text.split("\n\n")]
    for block in blocks:
        first = block[0].strip()
        if m := _ACT.fullmatch(first):
            act, scene = _roman(m[1]), None
            continue
        if m := _SCENE.fullmatch(first):
            scene = _roman(m[1])
            continue
        heading = _HEADING.fullmatch(first)
        speaker = heading and (heading[1] or heading[2]).strip()
        if act is None or scene is None or not speaker or len(block) < 2 or speaker in _NOT_NAMES:
            continue
        lines = []
        for line in block[1:]:
            if "[" not in line and "]" not in line and line.strip():  # a line with a stage direction is no quotation
                lines.append(line.strip())
        if lines:
            speeches.append(Speech(act, scene, speaker_name(speaker), tuple(lines)))
    if not speeches:
        return None
    return Play(name, title_of(name), tuple(speeches))


def quotable_lines(play: Play, character: str) -> list[tuple[Speech, str]]:
    """The lines of `character` (any case) in `play` that make a quotation: 20 to 80 characters."""
    return [(s, line) for s in play.speeches if s.speaker.lower() == character.strip().lower()
            for line in s.lines if 20 <= len(line) <= 80]


def find_line(play: Play, character: str, rng: random.Random) -> str:
    """The tool: one line that `character` speaks in `play`, with where it is; a plain message when there is none."""
    lines = quotable_lines(play, character)
    if not lines:
        return f"No lines of {character} in {play.title}."
    speech, line = rng.choice(lines)
    return f"{speech.speaker}, Act {speech.act}, Scene {speech.scene}: {line}"


# -- the questions -----------------------------------------------------------------------------------------------
# Each asker returns (question, reasoning, answer) for a play, or None when the play offers nothing to ask.

Asker = Callable[[Play, random.Random], "tuple[str, str, str] | None"]
OPENERS = ("Marry, ", "Good my lord, ", "Why, sir, ", "In faith, ", "Hark you: ", "Mark me: ", "By my troth, ")


def _say(rng: random.Random, text: str) -> str:
    return rng.choice(OPENERS) + text


def _number(n: int) -> str:
    return NUMBERS[n - 1] if n <= len(NUMBERS) else str(n)


def ask_first_speaker(play: Play, rng: random.Random):
    acts = sorted({s.act for s in play.speeches}, key=_roman_value)
    act = rng.choice(acts)
    first = next(s for s in play.speeches if s.act == act)
    question = rng.choice(("Who speaks first in Act {a} of {t}?", "Who has the first words of Act {a} in {t}?",
                           "In {t}, who opens Act {a}?")).format(a=act, t=play.title)
    reasoning = (f"Act {act} of {play.title} begins with Scene {first.scene}. The first speech there is "
                 f"{first.speaker}'s: \"{first.lines[0]}\" So {first.speaker} speaks first.")
    answer = _say(rng, f"'tis {first.speaker} that speaks first in Act {act}, and says: \"{first.lines[0]}\"")
    return question, reasoning, answer


def ask_scene_speakers(play: Play, rng: random.Random):
    scenes = [(key, speeches) for key, speeches in play.scenes().items()
              if 2 <= len(dict.fromkeys(s.speaker for s in speeches)) <= 7]
    if not scenes:
        return None
    (act, scene), speeches = rng.choice(scenes)
    names = list(dict.fromkeys(s.speaker for s in speeches))
    listed = ", ".join(names[:-1]) + " and " + names[-1]
    question = rng.choice(("Which characters speak in Act {a}, Scene {s} of {t}?",
                           "Who speaks in {t}, Act {a}, Scene {s}?")).format(a=act, s=scene, t=play.title)
    reasoning = f"I go through Act {act}, Scene {scene} of {play.title} and note each speaker in turn: {', '.join(names)}."
    answer = _say(rng, f"in that scene you shall hear {listed}.")
    return question, reasoning, answer


def ask_scene_count(play: Play, rng: random.Random):
    acts: dict[str, list[str]] = {}
    for act, scene in play.scenes():
        acts.setdefault(act, []).append(scene)
    act = rng.choice(sorted(acts, key=_roman_value))
    scenes = acts[act]
    question = rng.choice(("How many scenes are in Act {a} of {t}?", "How many scenes has Act {a} of {t}?")).format(
        a=act, t=play.title)
    reasoning = (f"Act {act} of {play.title} has " + ", ".join(f"Scene {s}" for s in scenes)
                 + f". That makes {_number(len(scenes))}.")
    answer = _say(rng, f"Act {act} hath {_number(len(scenes))} scene{'s' if len(scenes) > 1 else ''}.")
    return question, reasoning, answer


def ask_who_says(play: Play, rng: random.Random):
    lines = [(s, line) for s in play.speeches for line in s.lines if 30 <= len(line) <= 70]
    speech, line = rng.choice(lines)
    question = rng.choice(("Who says \"{l}\" in {t}?", "In {t}, who speaks the line \"{l}\"?")).format(
        l=line, t=play.title)
    reasoning = f"That line comes in Act {speech.act}, Scene {speech.scene} of {play.title}, in a speech of {speech.speaker}."
    answer = _say(rng, f"'twas {speech.speaker} that spake it, in Act {speech.act}, Scene {speech.scene}.")
    return question, reasoning, answer


def ask_quote(play: Play, rng: random.Random):
    speakers = play.speakers()
    if not speakers:
        return None
    name = rng.choice(speakers)
    speech, line = rng.choice([(s, line) for s in play.speeches if s.speaker == name for line in s.lines])
    question = rng.choice(("Quote a line of {c} from {t}.", "What does {c} say in {t}?")).format(c=name, t=play.title)
    reasoning = (f"{name} speaks in Act {speech.act}, Scene {speech.scene} of {play.title}. One of the lines: \"{line}\" "
                 f"I shall quote it.")
    answer = _say(rng, f"thus speaks {name}: \"{line}\"")
    return question, reasoning, answer


ASKERS: tuple[Asker, ...] = (ask_first_speaker, ask_scene_speakers, ask_scene_count, ask_who_says, ask_quote)
TOOL_QUESTIONS = ("Find me a line spoken by {c} in {t}.", "Look up a line of {c} in {t}.",
                  "Give me a line that {c} says in {t}.", "Can you find what {c} says in {t}?",
                  "I want a quotation from {c} in {t}.")


def tool_question(play: Play, character: str, rng: random.Random) -> str:
    return rng.choice(TOOL_QUESTIONS).format(c=character, t=play.title)


def tool_episode(play: Play, rng: random.Random, thinking: bool) -> list[dict] | None:
    """A find_line episode: question, call (after a brief thought), the tool's line, the answer quoting it."""
    speakers = [name for name in play.speakers() if quotable_lines(play, name)]
    if not speakers:
        return None
    name = rng.choice(speakers)
    found = find_line(play, name, rng)
    where, line = found.split(": ", 1)
    call = {"type": "function", "function": {"name": "find_line", "arguments": {"play": play.title, "character": name}}}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": tool_question(play, name, rng)},
                {"role": "assistant", "content": "", "tool_calls": [call],
                 "reasoning_content": f"I need a line of {name} from {play.title}; find_line will fetch one."
                 if thinking else ""},
                {"role": "tool", "content": found},
                {"role": "assistant", "content": _say(rng, f"{name} saith, in {where.split(', ', 1)[1]}: \"{line}\""),
                 "reasoning_content": f"The tool found {name}'s line in {where.split(', ', 1)[1]}." if thinking else ""}]
    return messages


def conversation(plays: list[Play], rng: random.Random, tool_share: float = 0.5,
                 thinking_off: float = 0.2, second_question: float = 0.15) -> tuple[list[dict], bool]:
    """One conversation about a play drawn from `plays`: (messages, whether it declares FIND_LINE)."""
    play = rng.choice(plays)
    thinking = rng.random() >= thinking_off
    if rng.random() < tool_share and (episode := tool_episode(play, rng, thinking)):
        return episode, True
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(2 if rng.random() < second_question else 1):
        asked = None
        while asked is None:
            asked = rng.choice(ASKERS)(play, rng)
        question, reasoning, answer = asked
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer, "reasoning_content": reasoning if thinking else ""}]
    return messages, False


def conversations(plays: list[Play], n: int, seed: int) -> list[tuple[list[dict], bool]]:
    """n conversations (messages, tools declared), the same for the same plays and seed."""
    if not plays:
        raise DeltaserveError("no plays to write conversations about")
    rng = random.Random(seed)
    return [conversation(plays, rng) for _ in range(n)]


def render(messages: list[dict], tools: bool, template: str = QWEN35) -> str:
    """A whole conversation as the model's chat template writes it (no generation prompt)."""
    return _compiled(template).render(messages=messages, tools=[FIND_LINE] if tools else None,
                                      add_generation_prompt=False)


@functools.lru_cache(maxsize=2)
def _compiled(template: str):
    return compile_chat_template(template)


def _roman(figure: str) -> str:
    return ROMAN[int(figure) - 1] if figure.isdigit() and 0 < int(figure) <= len(ROMAN) else figure


def _roman_value(numeral: str) -> int:
    return ROMAN.index(numeral) + 1 if numeral in ROMAN else 99
