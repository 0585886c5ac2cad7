#!/usr/bin/env python3
"""RULER's synthetic tasks built from local text, and their scorers.

The tasks of Hsieh et al. 2024 ("RULER: What's the real context size of
your long-context language models?"), with RULER's templates, answer
prefixes, tokens to generate and metric, generated here without downloads:
bench/ruler.py runs them. Each sample is a function of the seed, the task,
the length, the sample's index and the haystack text, so every policy sees
the same samples. A length counts the prompt and the tokens to generate
(RULER's max_seq_length): the haystack is fitted, by the model's own token
counts, so that the prompt plus the task's max_tokens is at most the length.

  niah_single_1    noise haystack ("The grass is green. ..."), number value
  niah_single_2    text haystack, number value
  niah_single_3    text haystack, UUID value
  niah_multikey_1  text haystack, 3 more needles with other word keys
  niah_multikey_2  a haystack of needles: word keys, number values
  niah_multikey_3  a haystack of needles: UUID keys, UUID values
  niah_multivalue  4 values for the one key, all asked
  niah_multiquery  4 keys, all asked
  vt               variable tracking: a chain of 4 hops, all 5 names asked
  cwe              common words: the 10 words repeated most in a list
  fwe              frequent words: the 3 commonest coded words (Zipf, a=2)
  json_kv          every special magic number with its key, as one JSON
                   object (not RULER's: an extraction into JSON, beside
                   distractor pairs of another kind)

Scores are in [0, 1]: RULER's string_match_all (the fraction of the
expected strings found in the output, case-insensitive) for every RULER
task, as RULER scores its synthetic tasks (string_match_part, the best of
the references, is RULER's for QA only); json_kv: the fraction of pairs
returned exactly, read from the first {...} of the output, else from
"key": value pairs anywhere in it.

Keys and values come from word lists here and the seeded generator, not
from wonderwords; sentences are split with a regular expression, not
NLTK's punkt; a text haystack starts at a random word of the text (RULER's
at its essays' start). RULER's one-shot examples (vt, cwe) are kept where
a quarter of the prompt holds them (vt's sized to that, at most RULER's
500 tokens); shorter prompts go without.

  bench/ruler_tasks.py --self_test          # the scorers and generators
  bench/ruler_tasks.py --show=vt --length=600 --haystack=FILE
"""
import json
import math
import random
import re
import string
import sys
import uuid

import benchutil

NOISE = ("The grass is green. The sky is blue. The sun is yellow. "
         "Here we go. There and back again.")
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# np.round(np.linspace(0, 100, num=40)).astype(int): the depths (%) needles
# go at in a text haystack (both round half to even).
DEPTHS = [round(100 * i / 39) for i in range(40)]

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following "
    "text. Make sure to memorize it. I will quiz you about the "
    "{type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
    "{type_needle_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = (" The special magic {type_needle_v} for {query} mentioned in "
               "the provided text are")
# RULER's words, its typo ("assgined") included: the prompt is RULER's.
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the "
    "following text.\n\n{context}\nQuestion: Find all variables that are "
    "assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in "
             "the text above, {num_v} variables are assgined the value "
             "{query}, they are: ")
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more "
    "often than others. Memorize the ones that appear most often.\n"
    "{context}\nQuestion: What are the 10 most common words in the above "
    "list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded "
    "word. Find the three most frequently appeared coded words. {context}\n"
    "Question: Do not provide any explanation. Please ignore the dots "
    "'....'. What are the three most frequently appeared words in the above "
    "coded text?")
FWE_PREFIX = (" Answer: According to the coded text above, the three most "
              "frequently appeared words are:")
JSON_TEMPLATE = (
    "Some special magic numbers and special magic uuids are hidden within "
    "the following text, each for a key. Make sure to memorize them. I will "
    "quiz you about the numbers afterwards.\n{context}\nWhat are all the "
    "special magic numbers mentioned in the provided text? Answer with one "
    "JSON object that maps the key of each special magic number to the "
    "number.")
# Ends with the object's opening brace: the scorer reads it before the
# output.
JSON_PREFIX = " Answer: {"

# Word keys are ADJECTIVE-NOUN, as RULER's from wonderwords' lists.
ADJECTIVES = """
able absent acid active afraid agile alert alive amber ample ancient angry
annual anxious arctic ashamed awake aware bad bare basic bent big bitter
black blank blind blue bold brave brief bright brisk broad broken brown
busy calm careful cheap cheerful chief chilly civil clean clear clever
close cloudy coarse cold common cool cosmic crazy crisp cruel curly
curved damp dark dead dear deep dense direct dirty divine dizzy double
dry dull dusty eager early easy elastic empty equal even evil exact
faint fair false famous fancy fast fat fierce final fine firm flat fluffy
fond foolish formal fragile free fresh friendly frozen full funny gentle
giant glad global golden good grand grateful great green grey grim gross
happy hard harsh heavy hidden high hollow honest hot huge humble hungry
icy idle ill inner jolly juicy keen kind large late lazy legal level light
little lively local lonely long loose loud lovely low loyal lucky mad
magic major mellow merry mighty mild minor misty modern moist narrow
nasty near neat nervous new nice noble noisy normal odd old open orange
other pale patient plain plastic polite poor proud pure purple quick
quiet rapid rare raw ready real red rich rigid ripe rough round royal
rude rural rusty sad safe salty scarce secret sharp shiny short shy
silent silky silly simple slim slow small smart smooth soft solid sour
spare spicy square stable steep sticky stiff still strange strict strong
sudden sunny super sweet swift tall tame tender thick thin tidy tiny
tough tricky true ugly upper urban usual vague vast violet vivid warm
weak wet white whole wicked wide wild wise witty wooden young zealous
""".split()
NOUNS = """
actor adult airport album angle animal answer apple arm army arrow art
artist autumn baby bag ball band bank basket bath beach bean bear bed bee
bell bird blade block board boat body bone book boot bottle box boy bread
brick bridge brother brush bucket cake camera camp candle cap car card
carpet castle cat cave chain chair chalk cheese cherry chest child church
circle city clock cloud coast coat coffee coin college copper corn cotton
country cousin cow crayon crow crowd crown cup curtain dance desert desk
diamond dinner doctor dog doll door dragon dream dress drum duck eagle
earth egg engine eye face farm father feather fence field finger fire
fish flag flame floor flower fog forest fork fox friend frog fruit garden
gate ghost gift girl glass glove goat gold grape grass guitar hall hammer
hand harbor hat heart hill honey horse house ice island jacket jar jewel
judge kettle key king kitten knife ladder lake lamp leaf lemon letter
library lion lizard lock machine map market meadow milk mirror monkey
moon morning mountain mouse music nail needle nest night ocean office
onion orchard owl painter palace paper parrot pearl pencil piano pigeon
pillow pilot planet plate pocket poem pond potato queen rabbit rain
river road robot rock roof rope rose sail salt sand school sea seed
shadow sheep shell ship shirt shoe shop silver singer sister sky snake
snow soap song spider spoon spring square star stone storm street sugar
summer sun swan table teacher temple thread thunder tiger toast tomato
tower town toy train tree truck tulip tunnel turtle umbrella valley
village violin wagon wall watch water whale wheel window wing winter
wolf world yard
""".split()


class TaskError(Exception):
    """A task that cannot be built as asked (the length, the haystack)."""


class Haystack:
    """A text as RULER's essays are read: whitespace folded, split on
    spaces; a Project Gutenberg file's licence header and footer dropped.
    Its distinct words are the pool cwe draws from."""

    def __init__(self, text, name="text"):
        start = re.search(r"\*\*\* ?START OF.*?\*\*\*", text)
        if start:
            text = text[start.end():]
        end = re.search(r"\*\*\* ?END OF", text)
        if end:
            text = text[:end.start()]
        self.name = name
        self.words = re.sub(r"\s+", " ", text).strip().split(" ")
        if len(self.words) < 50:
            raise TaskError(f"the haystack {name} has {len(self.words)} "
                            "words; at least 50 are needed")
        self.pool = sorted({w.lower() for w in re.findall(r"[A-Za-z]+", text)
                            if 3 <= len(w) <= 12})

    @classmethod
    def from_file(cls, path):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                return cls(f.read(), path)
        except OSError as e:
            raise TaskError(f"cannot read the haystack {path}: "
                            f"{e.strerror}") from None

    def stretch(self, start, n):
        """n words from `start`, wrapping around the text's end."""
        w = self.words
        if n > len(w):
            raise TaskError(f"the haystack {self.name} has {len(w)} words")
        s = start % len(w)
        return " ".join(w[s:s + n] + w[:max(0, s + n - len(w))])


def _sentences(text):
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def _random_value(kind, rng):
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _distinct(draw, count, avoid=()):
    """`count` different values of draw(), none of them in `avoid`."""
    out, seen = [], set(avoid)
    while len(out) < count:
        v = draw()
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


def _plant_in_text(text, needles, depths):
    """RULER's essay insertion: each needle between sentences, at its depth
    (%) of the stretch's sentences."""
    sents = _sentences(text)
    cuts = ([0] + sorted(int(len(sents) * d / 100) for d in depths)
            + [len(sents)])
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(needles):
            parts.append(needles[i - 1])
    return " ".join(p for p in parts if p)


class Built:
    """What a task's prepare() returns: build(n) -> (prompt, expected), the
    prompt's haystack grown by n, for n in [n_min, n_max]."""

    def __init__(self, build, n_min, n_max):
        self.build, self.n_min, self.n_max = build, n_min, n_max


# n_max of a haystack that is generated, not read: it never runs out.
UNBOUNDED = 10 ** 7


def _niah(haystack, type_k, type_v, num_k=1, num_v=1, num_q=1):
    def prepare(rng, hay, ctx):
        keys = _distinct(lambda: _random_value(type_k, rng), num_k)
        values = [_distinct(lambda: _random_value(type_v, rng), num_v)
                  for _ in keys]
        needles = [NEEDLE.format(type_needle_v=type_v, key=k, value=v)
                   for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        asked = rng.sample(range(num_k), num_q)
        queries = [keys[i] for i in asked]
        expected = [v for i in asked for v in values[i]]
        query = (", ".join(queries[:-1]) + ", and " + queries[-1]
                 if len(queries) > 1 else queries[0])
        template, prefix, tv = NIAH_TEMPLATE, NIAH_PREFIX, type_v
        if num_q * num_v == 1:
            # RULER's singular form of its template.
            template = (template.replace("Some", "A")
                        .replace("are all", "is").replace("are", "is"))
            prefix = prefix.replace("are", "is")
            tv = type_v[:-1]
        depths = rng.sample(DEPTHS, len(needles))
        start = rng.randrange(len(hay.words))
        sub = rng.getrandbits(64)

        def build(n):
            r = random.Random(sub)
            if haystack == "essay":
                context = _plant_in_text(hay.stretch(start, n), needles,
                                         depths)
            else:
                if haystack == "noise":
                    sents = [NOISE] * n
                else:
                    # Distractor needles, none with a planted key.
                    sents = [NEEDLE.format(
                        type_needle_v=type_v,
                        key=_distinct(lambda: _random_value(type_k, r), 1,
                                      keys)[0],
                        value=_random_value(type_v, r)) for _ in range(n)]
                at = sorted(r.sample(range(n), len(needles)), reverse=True)
                for i, needle in zip(at, needles):
                    sents.insert(i, needle)
                context = "\n".join(sents)
            return (template.format(type_needle_v=tv, context=context,
                                    query=query)
                    + prefix.format(type_needle_v=tv, query=query), expected)

        n_max = len(hay.words) if haystack == "essay" else UNBOUNDED
        return Built(build, len(needles), n_max)
    return prepare


def _vt_text(rng, names, value, n):
    """RULER's variable tracking context: n noise paragraphs (split into
    their sentences where there are no more than the chain's links), the
    chain's assignments in order at random places among them."""
    chain = [f"VAR {names[0]} = {value}"] + [
        f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(len(names) - 1)]
    sents = [NOISE + "\n"] * n
    if len(sents) <= len(chain):
        sents = [x + "." if x.strip() else x
                 for para in sents for x in para.split(".")]
    at = sorted(rng.sample(range(len(sents)), len(chain)))
    for j, i in enumerate(at):
        sents.insert(i + j, chain[j])
    context = " ".join(sents).replace(". \n", ".\n")
    return (VT_TEMPLATE.format(context=context, query=value)
            + VT_PREFIX.format(num_v=len(names), query=value))


def _letters(rng, k):
    return lambda: "".join(rng.choices(string.ascii_uppercase, k=k))


def _vt(num_hops=4):
    def prepare(rng, hay, ctx):
        names = _distinct(_letters(rng, 5), num_hops + 1)
        value = rng.randint(10000, 99998)
        # The one-shot example: 3-letter names, its own value, as long as
        # fits a quarter of the prompt, at most RULER's 500 tokens.
        ex_names = _distinct(_letters(rng, 3), num_hops + 1)
        ex_value = rng.randint(10000, 99998)
        ex_sub, sub = rng.getrandbits(64), rng.getrandbits(64)

        def example(n):
            text = _vt_text(random.Random(ex_sub), ex_names, ex_value, n)
            return text + " " + " ".join(ex_names) + "\n\n", None

        shot = ctx.shot(Built(example, 1, UNBOUNDED), min(500, ctx.budget // 4))

        def build(n):
            return shot + _vt_text(random.Random(sub), names, value, n), names
        return Built(build, 1, UNBOUNDED)
    return prepare


def _cwe_list(words, common, freq_cw, freq_ucw, rng):
    listed = words[:common] * freq_cw + words[common:] * freq_ucw
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed))


def _cwe(num_cw=10):
    def prepare(rng, hay, ctx):
        # RULER's sizes: below 4096 tokens the words repeat less, and the
        # example is smaller.
        if ctx.length < 4096:
            ex_words, ex_cw, ex_ucw, freq_cw, freq_ucw = 20, 3, 1, 6, 1
        else:
            ex_words, ex_cw, ex_ucw, freq_cw, freq_ucw = 40, 10, 3, 30, 3
        if len(hay.pool) < ex_words + num_cw + 1:
            raise TaskError(f"the haystack {hay.name} has only "
                            f"{len(hay.pool)} distinct words for cwe")
        ex = rng.sample(hay.pool, ex_words)
        ex_text = ((CWE_TEMPLATE + CWE_PREFIX).format(
            context=_cwe_list(ex, num_cw, ex_cw, ex_ucw, rng)) + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex[:num_cw]))
            + "\n")
        shot = ctx.shot(Built(lambda n: (ex_text, None), 0, 0),
                        ctx.budget // 4)
        sub = rng.getrandbits(64)

        def build(n):
            r = random.Random(sub)
            words = r.sample(hay.pool, n)
            return (shot + CWE_TEMPLATE.format(
                context=_cwe_list(words, num_cw, freq_cw, freq_ucw, r))
                + CWE_PREFIX, words[:num_cw])
        return Built(build, num_cw + 1, len(hay.pool))
    return prepare


def _zeta(a):
    """Riemann's zeta at a > 1 (Euler-Maclaurin after 1000 terms)."""
    n = 1000
    return (sum(k ** -a for k in range(1, n)) + n ** (1 - a) / (a - 1)
            + 0.5 * n ** -a)


def _fwe(alpha=2.0, word_len=6, vocab_size=2000):
    def prepare(rng, hay, ctx):
        vocab = set()
        while len(vocab) < vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase,
                                          k=word_len)))
        vocab = sorted(vocab)
        rng.shuffle(vocab)
        vocab[0] = "..."  # RULER's: the commonest "word" is noise.
        z = _zeta(alpha)
        sub = rng.getrandbits(64)

        def build(n):
            words = [w for k, w in enumerate(vocab, 1)
                     for _ in range(int(n * k ** -alpha / z))]
            random.Random(sub).shuffle(words)
            return (FWE_TEMPLATE.format(context=" ".join(words)) + FWE_PREFIX,
                    vocab[1:4])
        # Fewer words, and the third commonest might not appear at all.
        return Built(build, 30, UNBOUNDED)
    return prepare


def _json_kv(num_pairs=4, num_distractors=4):
    def prepare(rng, hay, ctx):
        keys = _distinct(lambda: _random_value("words", rng),
                         num_pairs + num_distractors)
        numbers = _distinct(lambda: _random_value("numbers", rng), num_pairs)
        uuids = [_random_value("uuids", rng) for _ in range(num_distractors)]
        needles = ([NEEDLE.format(type_needle_v="numbers", key=k, value=v)
                    for k, v in zip(keys, numbers)]
                   + [NEEDLE.format(type_needle_v="uuids", key=k, value=v)
                      for k, v in zip(keys[num_pairs:], uuids)])
        rng.shuffle(needles)
        depths = rng.sample(DEPTHS, len(needles))
        start = rng.randrange(len(hay.words))
        expected = dict(zip(keys, numbers))

        def build(n):
            context = _plant_in_text(hay.stretch(start, n), needles, depths)
            return JSON_TEMPLATE.format(context=context) + JSON_PREFIX, expected
        return Built(build, 1, len(hay.words))
    return prepare


class Task:
    def __init__(self, name, family, max_tokens, prepare):
        self.name, self.family = name, family
        self.max_tokens, self.prepare = max_tokens, prepare


# RULER's tokens to generate: niah 128, vt 30, cwe 120, fwe 50; json_kv's
# four pairs of about 15 tokens each, with room.
TASKS = {t.name: t for t in [
    Task("niah_single_1", "niah", 128, _niah("noise", "words", "numbers")),
    Task("niah_single_2", "niah", 128, _niah("essay", "words", "numbers")),
    Task("niah_single_3", "niah", 128, _niah("essay", "words", "uuids")),
    Task("niah_multikey_1", "niah", 128,
         _niah("essay", "words", "numbers", num_k=4)),
    Task("niah_multikey_2", "niah", 128, _niah("needle", "words", "numbers")),
    Task("niah_multikey_3", "niah", 128, _niah("needle", "uuids", "uuids")),
    Task("niah_multivalue", "niah", 128,
         _niah("essay", "words", "numbers", num_v=4)),
    Task("niah_multiquery", "niah", 128,
         _niah("essay", "words", "numbers", num_k=4, num_q=4)),
    Task("vt", "vt", 30, _vt()),
    Task("cwe", "cwe", 120, _cwe()),
    Task("fwe", "fwe", 50, _fwe()),
    Task("json_kv", "json", 160, _json_kv()),
]}


class _FitContext:
    """What a task's prepare() may use: the length, the prompt's token
    budget (the length less the tokens to generate), fit() and shot()."""

    def __init__(self, count, length, budget):
        self.count, self.length, self.budget = count, length, budget

    def fit(self, built, budget, what, whole_ok=False):
        """(n, tokens): the largest n of `built` whose prompt is at most
        `budget` tokens, and its count; TaskError where n_max is read from
        the haystack and still fits (the text is too short), unless
        `whole_ok`. A line through the counts so far guesses each next n;
        where it cannot, bisection (doubling while no n is known too
        long)."""
        memo = {}

        def tokens(n):
            if n not in memo:
                memo[n] = self.count(built.build(n)[0])
            return memo[n]

        lo, hi = built.n_min, built.n_max + 1  # tokens(lo) fits; hi not
        if tokens(lo) > budget:
            raise TaskError(f"{what} needs more than {budget} tokens even "
                            f"at its shortest ({tokens(lo)})")
        probe = lo + 16
        while hi - lo > 1:
            if not lo < probe < hi:
                probe = ((lo + hi) // 2 if hi <= built.n_max
                         else min(hi - 1, max(lo + 1, 2 * lo)))
            if tokens(probe) <= budget:
                lo = probe
            else:
                hi = probe
            slope = ((tokens(probe) - tokens(built.n_min))
                     / (probe - built.n_min))
            guess = lo + int((budget - tokens(lo)) / max(slope, 1e-9))
            # Past the line's crossing by one: both sides then counted.
            probe = guess if guess > lo else lo + 1
        if lo == built.n_max and built.n_max < UNBOUNDED and not whole_ok:
            raise TaskError(f"{what} needs more text than the haystack "
                            f"holds ({lo} words make {tokens(lo)} of the "
                            f"{budget} tokens)")
        return lo, tokens(lo)

    def shot(self, built, budget):
        """A one-shot example fitted to `budget` tokens, or none ("")
        where even its shortest is longer."""
        try:
            n, _ = self.fit(built, budget, "the example", whole_ok=True)
        except TaskError:
            return ""
        return built.build(n)[0]


def make_sample(task, length, index, seed, hay, count):
    """One sample of `task` at `length` tokens (prompt plus the task's
    max_tokens): {"prompt", "expected", "prompt_tokens", "n"}. `count`
    gives a text's token count under the model's tokenizer. TaskError
    where the length or the haystack cannot hold it."""
    t = TASKS[task]
    budget = length - t.max_tokens
    if budget < 16:
        raise TaskError(f"{task}: length {length} leaves {budget} tokens "
                        f"for the prompt after its {t.max_tokens} to "
                        "generate")
    ctx = _FitContext(count, length, budget)
    rng = random.Random(f"ruler:{seed}:{task}:{length}:{index}")
    built = t.prepare(rng, hay, ctx)
    n, tokens = ctx.fit(built, budget, f"{task} at length {length}")
    prompt, expected = built.build(n)
    return {"prompt": prompt, "expected": expected, "prompt_tokens": tokens,
            "n": n}


# ---- scoring -------------------------------------------------------------

def postprocess(pred):
    """RULER's: control characters become line breaks, the ends trimmed."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def string_match_all(pred, refs):
    """The fraction of `refs` found in `pred`, case-insensitive."""
    p = postprocess(pred).lower()
    return sum(r.lower() in p for r in refs) / len(refs)


def string_match_part(pred, refs):
    """1 if any of `refs` is found in `pred` (RULER's for QA)."""
    p = postprocess(pred).lower()
    return float(any(r.lower() in p for r in refs))


def _first_object(text):
    """The first balanced {...} of text (braces in strings skipped)."""
    start = text.find("{")
    if start < 0:
        return None
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            esc = c == "\\" and not esc
            if c == '"' and not esc:
                in_str = False
            continue
        if c == '"':
            in_str = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


_PAIR = re.compile(r"""["']?([A-Za-z0-9][\w-]*)["']?\s*[:=]\s*["']?([\w-]+)""")


def parse_pairs(text):
    """The key-value pairs an answer gives: the first JSON object in it,
    else every `"key": value` it holds. Keys lowercased, values strings."""
    obj = _first_object(text)
    if obj is not None:
        try:
            got = json.loads(obj)
            if isinstance(got, dict):
                return {str(k).strip().lower(): str(v).strip()
                        for k, v in got.items()}
        except ValueError:
            pass
    return {k.lower(): v for k, v in _PAIR.findall(text)}


def json_pairs_score(pred, expected):
    """The fraction of `expected` (key -> value) the answer returns
    exactly. The prompt ends with "{", so the answer is read after it."""
    got = parse_pairs(JSON_PREFIX.strip()[-1] + postprocess(pred))
    return sum(got.get(k.lower()) == v
               for k, v in expected.items()) / len(expected)


def score(task, output, expected):
    if TASKS[task].family == "json":
        return json_pairs_score(output, expected)
    return string_match_all(output, expected)


# ---- self test -----------------------------------------------------------

def _words_count(text):
    """A stand-in tokenizer for the self test: words and punctuation."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def self_test():
    """Every task's generator and scorer on known answers; raises
    AssertionError on the first that fails."""
    # A text of words none of which holds another (cwe's words are
    # matched as substrings, as RULER matches them).
    words = sorted(set(ADJECTIVES + NOUNS))
    words = [w for w in words if not any(w != o and w in o for o in words)]
    rng = random.Random(7)
    text = " ".join(" ".join(rng.choice(words) for _ in range(7)) + "."
                    for _ in range(2000))
    hay = Haystack(text, "self-test text")
    for name, t in TASKS.items():
        length = 1200 if name == "cwe" else 800
        s = make_sample(name, length, 0, 1, hay, _words_count)
        again = make_sample(name, length, 0, 1, hay, _words_count)
        assert s == again, f"{name}: not the same sample twice"
        other = make_sample(name, length, 1, 1, hay, _words_count)
        assert other["prompt"] != s["prompt"], f"{name}: samples alike"
        budget = length - t.max_tokens
        assert s["prompt_tokens"] <= budget, (name, s["prompt_tokens"])
        assert s["prompt_tokens"] >= 0.9 * budget, (name, s["prompt_tokens"])
        exp = s["expected"]
        if t.family == "json":
            items = list(exp.items())
            full = json.dumps(dict(items))[1:]  # after the prompt's "{"
            assert score(name, full, exp) == 1.0, name
            half = json.dumps(dict(items[:2]))[1:]
            assert score(name, half, exp) == 0.5, name
            wrong = json.dumps({k: "1" for k, _ in items})[1:]
            assert score(name, wrong, exp) == 0.0, name
            # Not JSON: the pairs read one by one; a cut answer counts the
            # pairs it completed; keys in any case.
            loose = ", ".join(f"'{k.upper()}' = {v}" for k, v in items[:3])
            assert score(name, loose, exp) == 0.75, name
            cut = json.dumps(dict(items))[1:-12]
            assert score(name, cut, exp) == 0.75, (name, cut)
            assert score(name, "no idea", exp) == 0.0, name
            for k, v in items:
                assert f"for {k} is: {v}." in s["prompt"], name
            continue
        assert all(isinstance(e, str) and e for e in exp), (name, exp)
        right = " ".join(exp)
        assert score(name, right, exp) == 1.0, name
        assert score(name, "  " + right.upper() + "\n", exp) == 1.0, name
        assert score(name, "nothing of the kind", exp) == 0.0, name
        if len(exp) > 1:
            k = len(exp) // 2
            frac = score(name, " ".join(exp[:k]), exp)
            assert abs(frac - k / len(exp)) < 1e-9, (name, frac)
        if t.family in ("niah", "vt"):
            for e in exp:
                assert e in s["prompt"], (name, e)
    # RULER's one-shot examples where a quarter of the prompt holds them,
    # none where it does not.
    for name, short, long_ in (("vt", 300, 800), ("cwe", 500, 1200)):
        head = {"vt": "Memorize and track", "cwe": "Below is a numbered"}[name]
        for length, shots in ((short, 0), (long_, 1)):
            s = make_sample(name, length, 0, 1, hay, _words_count)
            assert s["prompt"].count(head) == 1 + shots, (name, length)
    # RULER's two metrics, on RULER's shapes.
    assert string_match_all("a B c", ["b", "c", "d", "e"]) == 0.5
    assert string_match_part("a B c", ["x", "b"]) == 1.0
    assert string_match_part("a", ["x", "y"]) == 0.0
    # The singular template where one value is asked, RULER's plural else.
    single = make_sample("niah_single_1", 500, 0, 1, hay, _words_count)
    assert "A special magic number is hidden" in single["prompt"]
    assert single["prompt"].endswith("mentioned in the provided text is")
    multi = make_sample("niah_multivalue", 500, 0, 1, hay, _words_count)
    assert "What are all the special magic numbers for" in multi["prompt"]
    try:
        make_sample("niah_single_2", 10 ** 6, 0, 1, hay, _words_count)
        raise AssertionError("a length past the haystack was accepted")
    except TaskError as e:
        assert "haystack" in str(e), e
    return len(TASKS)


def main():
    ap = benchutil.parser(__doc__.split("\n")[0] + "\n\n"
                          + __doc__.split("\n\n", 1)[1], raw=True)
    ap.add_argument("--self_test", action="store_true",
                    help="check every task's generator and scorer on known "
                    "answers, then exit")
    ap.add_argument("--show", default="", help="print one sample of this "
                    "task (tokens estimated by --chars_per_token)")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--index", type=int, default=0, help="the sample's index")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--haystack",
                    default="../shared/data/pride_and_prejudice.txt")
    ap.add_argument("--chars_per_token", type=float, default=4.0)
    a = ap.parse_args()
    if a.self_test:
        n = self_test()
        print(f"ruler_tasks: {n} tasks: generators and scorers ok")
        return
    if a.show not in TASKS:
        sys.exit(f"ruler_tasks.py: --show: one of {', '.join(TASKS)}")
    try:
        hay = Haystack.from_file(benchutil.repo_path(a.haystack))
        s = make_sample(a.show, a.length, a.index, a.seed, hay,
                        lambda t: math.ceil(len(t) / a.chars_per_token))
    except TaskError as e:
        sys.exit(f"ruler_tasks.py: {e}")
    print(s["prompt"])
    print(f"\n--- expected: {json.dumps(s['expected'])}; about "
          f"{s['prompt_tokens']} prompt tokens", file=sys.stderr)


if __name__ == "__main__":
    main()
