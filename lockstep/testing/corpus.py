"""A small built-in text corpus for tests and benchmarks.

Everything here is written inline so that tests and benchmarks never download anything.
The corpus trains the tiny byte-level BPE tokenizer (see ``tiny_models.py``) and feeds
``random_prompt``; changing the text changes the tiny tokenizer, so bump
``tiny_models.TINY_VERSION`` whenever it is edited.
"""

from __future__ import annotations

import functools
import random

_ENGLISH = """\
The quick brown fox jumps over the lazy dog while the farmer counts his sheep.
A journey of a thousand miles begins with a single step, or so the old saying goes.
The river bends twice before it reaches the sea, and the town grew up around the second bend.
She opened the window, listened to the rain, and decided that the letter could wait until morning.
Every morning the baker lights the oven at four o'clock and sells the first loaf at six.
The library closes at nine on weekdays and at noon on Saturdays; it never opens on Sundays.
Scientists measured the temperature of the lake every hour for thirty-one days in a row.
The committee met on Tuesday, argued for three hours, and agreed to meet again next week.
If the train leaves at 7:45 and travels at 80 km/h, it arrives a little after ten.
My grandmother kept a garden with tomatoes, beans, onions, and a single stubborn lemon tree.
The lighthouse keeper wrote in his log: "Wind from the north, heavy fog, no ships sighted."
Children ran across the field, chasing a red kite that refused to stay in the sky.
The museum's new exhibit shows maps drawn by sailors who never saw the coasts they described.
He paid $12.50 for the book, read half of it on the bus, and left it on the seat by mistake.
Mountains in the west catch the first snow of the year, usually in the middle of October.
The recipe calls for two cups of flour, one egg, a pinch of salt, and plenty of patience.
In the evening the square fills with musicians, tourists, pigeons, and people selling ice cream.
The engineer checked each bolt twice, then once more, because the bridge would carry a train.
Nobody remembered who had planted the oak tree, but everyone agreed it was older than the church.
The storm knocked out the power for two days, so the whole street cooked dinner on one grill.
Learning a language is like building a house: you lay one brick at a time, every single day.
The cat slept on the warm roof of the car until the owner came out and started the engine.
A good map tells you where you are; a great map also tells you what you might find there.
The orchestra tuned their instruments while the audience whispered and searched for seats.
Our neighbor collects old clocks, and at noon every one of them chimes at a slightly different time.
The hikers reached the summit at dawn, tired and cold, and watched the valley slowly turn gold.
Water boils at 100 degrees Celsius at sea level, but at a lower temperature on a high mountain.
The shop on the corner sells newspapers, stamps, batteries, and surprisingly good coffee.
When the tide goes out, the bay becomes a wide plain of wet sand full of shells and small crabs.
The teacher asked a simple question, and the room went quiet for a long, thoughtful minute.
Please remember to water the plants, feed the fish, and lock the back door before you leave.
The year 1969 is remembered for the first steps on the Moon and for a famous music festival.
Why do birds fly south in winter? Because the walk would take far too long, said the child.
The old road follows the valley floor, crossing the stream seven times before it climbs the pass.
A thousand lanterns floated down the river, and the whole city stood on the bridges to watch.
The detective looked at the muddy boots, the broken cup, and the clock that had stopped at three.
Bread, cheese, apples, and a flask of tea: the perfect lunch for a long afternoon of walking.
The printer jammed again, so she wrote the report by hand and delivered it in person.
Some questions have simple answers; others need a lifetime, a library, and a little luck.
The wind turbine on the hill turns slowly on calm days and hums loudly during storms.
He counted the stars until he lost track, then started again from one, and fell asleep at forty.
The market opens at dawn: fishermen bring the catch, farmers bring vegetables, and bakers bring bread.
Rain fell on the roofs, ran down the gutters, filled the streets, and finally reached the river.
The ship's captain studied the charts, checked the weather, and ordered the crew to raise the sails.
It was the best of times, it was the worst of times, and nobody could agree which one it was.
Numbers such as 3.14159, 2.71828, and 1.41421 appear again and again in mathematics.
The phone rang twice and stopped; a minute later it rang again, and this time she answered.
Snow covered the village overnight, and in the morning every roof looked like a loaf of bread.
The volunteers cleaned the beach, collected forty bags of plastic, and planted grass on the dunes.
A small boat drifted past the harbor wall, its single white sail bright against the grey water.
"Where are we going?" asked the youngest. "Somewhere new," replied her father with a smile.
The bakery, the bank, the bookshop, and the barber all share the same narrow street.
Trains, trams, buses, and ferries: the city has every kind of transport except a cable car.
Q: What is the capital of France? A: Paris. Q: And of Japan? A: Tokyo, of course.
Step 1: read the instructions. Step 2: gather the tools. Step 3: ignore the instructions and improvise.
The server answered the request in 42 milliseconds, which was fast enough for everybody.
def add(a, b): return a + b  # a tiny Python function that adds two numbers
for i in range(10): print(i * i)  # prints the first ten square numbers
SELECT name, age FROM users WHERE age > 30 ORDER BY name;
{"name": "lockstep", "version": 1, "tags": ["serving", "tests", "tiny"]}
https://example.com/index.html?page=2&sort=desc#section-3
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
January, February, March, April, May, June, July, August, September, October, November, December.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.
The sum of 17 and 25 is 42; the product of 6 and 7 is also 42, which pleased the students.
The garden gate creaked, the dog barked once, and the postman hurried back to his van.
Long ago, in a kingdom by the sea, there lived a princess who preferred books to balls.
The weather forecast promised sunshine, so naturally it rained from breakfast until dinner.
Each chapter of the novel ends with a question, and each new chapter begins with a different one.
"""

_MULTILINGUAL = """\
今天 天气 很好， 我们 去 公园 散步 吧。
我 喜欢 喝 茶， 也 喜欢 看 书。
東京 は 日本 の 首都 です。 桜 の 花 が 咲いて います。
ありがとう ございます、 また 明日。
서울 은 한국 의 수도 입니다。 감사 합니다。
Der schnelle braune Fuchs springt über den faulen Hund.
Le petit déjeuner est servi à huit heures, café et croissants compris.
¿Dónde está la estación? Está cerca del río, al lado del mercado.
Привет, как дела? Сегодня холодно, но солнечно.
Emoji time 😀 🎉 🚀 ❤️ 👍 🌍 🍕 ☕ 🐱 🐶 — party at the café!
Weather: ☀️ sunny, 🌧️ rainy, ❄️ snowy, 🌈 after the storm.
Math symbols: α + β = γ, ∑ x² ≤ ∞, π ≈ 3.14, √2 ≈ 1.414.
"""


@functools.lru_cache(maxsize=1)
def corpus_text() -> str:
    """The whole built-in corpus (English, a little code, then CJK / other scripts / emoji)."""
    return _ENGLISH + _MULTILINGUAL


@functools.lru_cache(maxsize=1)
def corpus_words() -> tuple[str, ...]:
    """Whitespace-separated words of the corpus, in corpus order (duplicates kept)."""
    return tuple(corpus_text().split())


def corpus_sentences() -> list[str]:
    """Non-empty lines of the corpus."""
    return [line for line in corpus_text().splitlines() if line.strip()]


def random_prompt(rng: random.Random, n_words: int) -> str:
    """A prompt of ``n_words`` words drawn from the corpus with ``rng``.

    Deterministic for a given ``rng`` state. The prompt is a contiguous run of corpus words
    (wrapping around at the end), so it reads like text rather than a bag of words, starting
    at a random word; the rng is advanced by exactly one draw.
    """
    if n_words < 0:
        raise ValueError(f"n_words must be >= 0, got {n_words}")
    words = corpus_words()
    start = rng.randrange(len(words))
    return " ".join(words[(start + i) % len(words)] for i in range(n_words))
