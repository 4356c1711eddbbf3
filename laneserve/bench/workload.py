"""The peers' benchmark workload (same corpus and windows as shared/peers/workload.py),
so laneserve's figures line up with the recorded HF / vLLM / llama.cpp ones.

Prompts are token ids: windows of a fixed English corpus tokenized without
special tokens; sequence i of a batch starts at token i * stride.
"""

from __future__ import annotations

NEW_TOKENS = 128
# name -> (prompt_len, stride between the windows of consecutive sequences)
CASES = {"short": (12, 12), "long": (200, 17)}

CORPUS = """\
The old lighthouse stood at the end of a narrow spit of rock, and for most of the year the only visitors were gulls, \
seals and the occasional fisherman who had misjudged the tide. Its keeper, a patient woman named Ilse, kept a logbook \
in which she wrote down the weather three times a day: the direction of the wind, the height of the waves, the colour \
of the sky at dawn and the number of ships that passed before noon. Over forty years the logbook grew into a shelf of \
notebooks, and the notebooks became a small archive that scientists from the mainland eventually came to study.

What they found surprised them. The records showed that storms had become more frequent in late autumn, that the first \
frost arrived about nine days later than it had when Ilse started, and that a certain species of seabird, once common on \
the northern cliffs, had almost disappeared. None of these changes were visible from one year to the next. They only \
appeared when someone patiently lined up thousands of small observations and looked at them together.

A computer works in a similar way when it learns from data. A single example tells it very little, but millions of \
examples, each one slightly different, reveal the patterns that connect them. A language model, for instance, reads an \
enormous amount of text and adjusts its internal numbers so that it becomes better at predicting the next word. After \
enough training it can complete sentences, answer questions, translate between languages and even write short programs, \
although it still makes mistakes that a careful human reader would notice at once.

Cooking offers another useful comparison. A recipe is a sequence of instructions, and each step depends on the ones \
before it. If you add the flour before the butter has melted, the sauce will form lumps; if you forget the salt, the \
bread will taste flat no matter how carefully it was kneaded. Good cooks learn to read the state of the dish as they go, \
tasting, smelling and adjusting, rather than following the instructions blindly. The best recipes explain not only what \
to do but why, so that the cook can recover when something goes wrong.

Cities grow in a way that is neither fully planned nor completely random. Roads follow old footpaths, markets appear \
where people already gather, and new neighbourhoods form around railway stations, schools and factories. Planners can \
encourage some patterns and discourage others, but they rarely control the whole picture. When a bridge is built or a \
tram line is closed, the effects spread slowly through the surrounding streets for decades, changing where people live, \
where they work and how long it takes them to travel between the two.

The history of mathematics contains many ideas that seemed useless when they were discovered. Imaginary numbers were \
treated as a curiosity for centuries before engineers used them to describe alternating current. Prime numbers were \
studied for their own beauty long before they became the foundation of the encryption that protects online payments. \
Non-Euclidean geometry was an abstract puzzle until physicists needed it to explain how gravity bends space and time. \
It is difficult to predict which pieces of knowledge will turn out to be important, which is one reason why curiosity \
deserves to be protected.

Gardening teaches patience in a way that few other activities do. Seeds planted in spring may not flower until summer, \
fruit trees can take years to bear their first crop, and a hedge planted today will only become a real hedge after a \
decade of careful pruning. Gardeners learn to think in seasons rather than days. They watch the soil, the light and the \
rain, and they keep notes about what worked and what failed, so that next year the garden is a little better than before.

Music, finally, shows how simple rules can produce endless variety. A scale has only a handful of notes, and a rhythm \
is just a pattern of long and short sounds, yet from these few ingredients composers have built symphonies, folk songs, \
jazz improvisations and lullabies. Listeners recognise a familiar melody even when it is played on a different \
instrument, in a different key or at a different speed, because what they remember is the structure of the tune rather \
than the exact sounds. The same is true of stories, recipes, cities and gardens: the structure is what lasts.
"""


def corpus_ids(tokenizer) -> list[int]:
    return tokenizer(CORPUS, add_special_tokens=False)["input_ids"]


def prompt_token_ids(ids: list[int], case: str, batch: int) -> list[list[int]]:
    length, stride = CASES[case]
    need = (batch - 1) * stride + length
    if len(ids) < need:
        raise ValueError(f"corpus has {len(ids)} tokens, case {case} x{batch} needs {need}")
    return [list(ids[i * stride : i * stride + length]) for i in range(batch)]
