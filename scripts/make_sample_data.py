#!/usr/bin/env python3
"""Write data/sample/: small files in the real formats, for the offline `tiny` config and the tests.

    python scripts/make_sample_data.py            # rewrites data/sample/ (deterministic)

- gutenberg/pg9000{1..4}.txt  four short books laid out like Project Gutenberg plain-text files:
  header lines (Title:, Author:, ...), `*** START OF ...` / `*** END OF ...` marker lines and end
  matter. They cover the marker variants the gutenberg stage accepts (THE / THIS, CRLF line ends,
  a byte-order mark, trailing spaces, no space after the stars) and a title that wraps.
- fineweb/sample_000.parquet  short educational articles with FineWeb-Edu's columns and types; a
  few rows have low int_score or language_score so the filters have something to remove.
- alpaca_data.json  instruction records in Stanford Alpaca's format, including two exact
  duplicates and one empty output for the cleaner to drop.
- hellaswag_val.jsonl  sentence-completion items with the fields of HellaSwag's validation file
  (ind, activity_label, ctx_a, ctx_b, ctx, split, split_type, label, endings, source_id): one
  sensible ending and three odd ones, in a seeded order.
- prefs/hh_train.jsonl.gz, prefs/ultrafeedback_train_prefs.parquet  the same preference pairs (a right
  answer chosen, a wrong or unhelpful one rejected; some two-turn dialogues) in Anthropic HH-RLHF's and
  UltraFeedback binarized's layouts, with pairs for the cleaner to drop (chosen == rejected, an empty
  response, transcripts that part before the last answer, a repeat).

Every sentence here was written for this project (some are assembled from small templates with a
seeded random generator); nothing is copied from the real data sets. The ebook numbers 90001-90004
and the example.org/.com/.net URLs are made up.
"""

from __future__ import annotations

import json
import random
import textwrap
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "data" / "sample"


# --------------------------------------------------------------------------------------------
# books
# --------------------------------------------------------------------------------------------

BOOKS = [
    {
        "id": 90001,
        "title": "The Lighthouse at Gull Point",
        "author": "Edith Marrow",
        "variant": "the",
        "people": ["Mara", "her father", "old Tobias", "the ferryman", "the schoolmaster"],
        "places": ["the lamp room", "the harbour wall", "the shingle beach", "the cottage kitchen", "the cliff path"],
        "things": ["the great lamp", "the brass telescope", "the logbook", "a coil of rope", "the kettle"],
        "moods": ["quiet", "restless", "patient", "stubborn", "hopeful"],
        "chapters": [
            """Gull Point stood at the end of a long finger of rock, and the lighthouse stood at the end of Gull Point, so that on a clear evening it looked as though the land itself had raised one white arm to warn the ships away. Mara had lived there all her life. She knew the number of steps in the tower, one hundred and twelve, and she knew which of them creaked when the wind came from the west.

Her father kept the light. Every evening at dusk he climbed to the lamp room, trimmed the wick, polished the lens until he could see his own tired face in it, and wrote the hour in the logbook. Mara carried up the oil. She was twelve years old and strong for her age, and she was proud that the light had never once failed while the two of them tended it.

"A lamp is only a promise," her father told her once, when she asked why he wrote in the book every night. "It says to the sailor, there is rock here, keep off. A promise has to be kept every single night, or it is worth nothing at all."

She thought about that for a long time afterwards. She thought about it on the morning the storm came.""",
            """The storm arrived from the south-west a little after noon. First the sky turned the colour of pewter, and then the sea began to heave in long grey ridges that broke white on the harbour wall. By three o'clock the rain was coming sideways, and the gulls had vanished from the cliffs as if they had never been.

Her father had gone to the village that morning to fetch a new glass for the lamp. The ferryman had promised to bring him back before dark, but Mara could see from the window that no boat would cross the bay in such weather. She stood with her hands pressed against the cold pane and understood, slowly and then all at once, that the light was hers to keep tonight.

She did not feel brave. She felt small, and the tower felt very tall. But she put on her father's oilskin coat, which came down past her knees, and she carried the can of oil up the hundred and twelve steps, counting each one aloud so that she would not have to listen to the wind.""",
            """In the lamp room the noise of the storm was enormous. The glass shook in its frames and the whole tower seemed to sway. Mara trimmed the wick the way her father did, with small careful cuts, and struck a match. It went out. She struck another, and shielded it with her body, and this time the flame caught and climbed and steadied.

Then she wound the clockwork that turned the lens, and the beam swept out across the dark water: once, twice, three times, and then a pause, which was the signal of Gull Point and of no other light on the coast.

At nine o'clock she saw the ship. It was a small coaster, riding low, and it was much too close to the rocks. For a terrible moment it seemed not to see the light at all. Then its bow swung slowly round, away from the point, and it crept past the reef and into the shelter of the bay. Mara sat down on the floor of the lamp room and found that she was crying, though she could not have said why.

She opened the logbook and wrote, in her best handwriting: Light lit at dusk. Storm from the south-west. One ship passed safely. Kept by M.""",
        ],
    },
    {
        "id": 90002,
        "title": "The Clockmaker of Ashford",
        "author": "Samuel Penhallow",
        "variant": "this-crlf",
        "people": ["Mr. Gresley", "young Will", "Mrs. Amberley", "the vicar", "the carter's boy"],
        "places": ["the workshop", "the market square", "the church tower", "the back parlour", "the narrow lane"],
        "things": ["the mainspring", "a loupe", "the pendulum", "a tray of tiny screws", "the tower clock"],
        "moods": ["careful", "weary", "curious", "cheerful", "thoughtful"],
        "chapters": [
            """There was a clockmaker in Ashford whose name was Elias Gresley, and every clock in the town had passed through his hands at least once. He was a thin man with spectacles pushed up on his forehead, and he had a habit of humming while he worked, always the same three notes, over and over, like the tick of something patient.

His shop was on the corner of the market square. In the window stood a tall case clock with a painted moon in its face, and children would stop on their way to school to watch the moon creep, day by day, from crescent to full and back again.

One autumn morning a boy named Will knocked at the shop door and asked to be taken on as an apprentice. He was fourteen, with ink on his fingers and a torn cap, and he had walked nine miles from the next valley to ask.

"Why clocks?" said Mr. Gresley, without looking up from his bench.

"Because they keep going," said Will. "Even when nobody is watching them."

The clockmaker put down his tweezers and looked at the boy properly for the first time. Then he nodded, and pointed to a stool, and that was the beginning of it.""",
            """Will learned slowly at first. He learned that a clock is a conversation between a falling weight and a swinging pendulum, and that the escapement is the polite servant who lets each of them speak in turn. He learned to clean a movement in a bath of spirit, to oil a pivot with a single bright drop and no more, and never, ever, to force a screw.

"If it will not turn," Mr. Gresley said, "it is telling you something. Listen to it before you argue with it."

In the evenings the old man told stories about the clocks he had mended: the clock that had stopped at the very minute its owner died, which was not magic but a broken suspension spring; the clock that ran fast only in summer, because its pendulum rod was made of cheap brass that grew longer in the heat; the clock that a farmer had tried to repair with a hairpin and a piece of string, and which, to everyone's surprise, had worked for eleven years.""",
            """In the second winter the tower clock of Ashford church began to lose time. Each day it fell a little further behind, two minutes, then five, then nine, until the whole town was late for everything and arguing about whose fault it was.

Mr. Gresley's knees were too stiff for the ladder, so it was Will who climbed up into the tower with a lantern and a bag of tools. He found the great iron movement covered in dust and pigeon feathers. He cleaned it, and oiled it, and watched it for an hour, and still it ran slow.

At last he noticed that the bob of the pendulum had slipped a little way down its rod. Someone, long ago, had tightened the nut with a pair of pliers and cracked it. Will cut a new nut from a piece of brass that night in the workshop, filing it by candlelight while the old man slept in his chair.

The next morning the tower clock struck eight at eight o'clock exactly, and people in the square looked up at it, and then at their own watches, and then at one another, as if they had forgotten that such a thing was possible.""",
        ],
    },
    {
        "id": 90003,
        "title": "Letters from the Valley",
        "author": "Harriet Quill",
        "variant": "bom-spaces",
        "people": ["Anna", "the children", "Mrs. Dunmore", "the blacksmith", "little Peter"],
        "places": ["the schoolroom", "the orchard", "the river bank", "the post office", "the hill road"],
        "things": ["a slate", "the stove", "a bundle of letters", "a basket of apples", "the school bell"],
        "moods": ["tired", "glad", "homesick", "amused", "determined"],
        "chapters": [
            """My dear Thomas,

I have arrived, and I am alive, and the valley is every bit as remote as you warned me it would be. The coach left me at the crossroads with my trunk and my umbrella, and I walked the last two miles with a farmer's cart creaking along behind me, carrying my things and a great many turnips.

The school is a single stone room with a stove in one corner and a map of the world on the wall, a very old map on which half of Africa is simply left blank. There are nineteen pupils. The youngest is five and cannot yet hold a pencil; the eldest is fifteen and reads better than I did at that age. They stared at me on the first morning as though I were a strange bird that had flown in through the window.

Do not worry about me. I am cold at night, and I miss the noise of the town, but I think I shall be useful here, and that is what I wanted.

Your loving sister,
Anna""",
            """My dear Thomas,

You ask what I teach. The answer is: everything, and all at once. While the little ones chant their letters, the middle ones do sums on their slates and the eldest read aloud from the one good history book, which is missing its last forty pages, so that in this valley the story of England stops abruptly in the year 1688.

Yesterday we went down to the river to study the water. I told them that the river carries soil from the hills to the sea, grain by grain, and that given enough time it could carry away a mountain. Little Peter asked how much time, and I said many thousands of years, and he thought about it and said that in that case he would rather not wait. The whole class laughed, and so did I.

The blacksmith has mended our stove, and refused to be paid, and Mrs. Dunmore sends up a loaf of bread every Monday. People here are not rich, but they are generous in a quiet way that makes no speeches about it.

Your loving sister,
Anna""",
            """My dear Thomas,

Spring has come to the valley at last. The orchard behind the school is white with blossom, and the children have begun to arrive with their pockets full of frogspawn in jars, which they present to me as though it were treasure. Perhaps it is.

I have decided to stay another year. I know that you hoped I would come home, and I know that Mother will say I am burying myself in the country. But yesterday the eldest girl, Ruth, told me that she wants to become a teacher too, and asked whether I thought she could. I said yes. I said it without hesitating, and I meant it, and I found that I could not imagine leaving before I had helped her to begin.

Write to me soon, and tell me all the news of the town. Here the only news is the weather, and the weather is beautiful.

Your loving sister,
Anna""",
        ],
    },
    {
        "id": 90004,
        "title": "A Winter Journey Across the Northern Hills",
        "subtitle": "Being the Account of a Surveyor and His Mule",
        "author": "Jonas Whitcombe",
        "variant": "nospace",
        "people": ["the surveyor", "Bartholomew the mule", "a shepherd", "the innkeeper", "two travelling tinkers"],
        "places": ["the high pass", "a frozen tarn", "the drovers' road", "a stone bothy", "the valley floor"],
        "things": [
            "the theodolite",
            "a chain of one hundred links",
            "the field notebook",
            "a flask of tea",
            "the map case",
        ],
        "moods": ["frozen", "cheerful", "doubtful", "grateful", "stubborn"],
        "chapters": [
            """I set out from Kelbridge on the second of December with a theodolite, a measuring chain, a notebook, and a mule named Bartholomew, who had been recommended to me as steady and who turned out to be steady chiefly in the sense that he could not easily be moved. My task was to survey the old drovers' road over the northern hills, so that the county might decide whether it was worth repairing.

The first day went well enough. The frost was hard and the sky was clear, and from the top of the first ridge I could see the whole country laid out below me like a map that someone had forgotten to colour in. I took my bearings, wrote down my figures, and ate my bread and cheese sitting on a rock, while Bartholomew ate the heather with an air of deep suspicion.

Surveying is a slow and patient business. One measures a line, and then another, and from the angles between them one builds, little by little, a true picture of the ground. A single careless reading can spoil a week of work, so one learns to check everything twice and to trust nothing, least of all one's own tired eyes at the end of a cold day.""",
            """On the third day the snow came. It began as a few idle flakes drifting across the path, and within an hour it had swallowed the hills entirely. I could not see fifty yards in any direction. The road, which had been plain enough beneath the frost, vanished under a smooth white blanket that gave no hint of where the ground was firm and where it fell away into the bog.

It was Bartholomew who saved us. He stopped, and would not go forward, and when I tried to lead him he set his feet and laid back his ears and made it plain that he would sooner die where he stood. I was angry with him for a full minute. Then I walked ten paces ahead on my own and found the edge of a frozen tarn, thinly iced, exactly where my next step would have been.

We turned back to a stone bothy I had passed an hour earlier and spent the night there, the mule and I, sharing the shelter of four walls and half a roof. I made a fire of heather roots and wrote up my notes by its light, and I confess that I apologised to Bartholomew more than once in the course of the evening.""",
            """The weather cleared on the fifth day, and we came down at last into the valley on the far side of the hills, where a shepherd gave us directions and an innkeeper gave us soup. My figures were complete. The road, I concluded, could be repaired for a reasonable sum, provided that a new causeway were built across the marshy ground below the high pass and a post with a bell were set beside the tarn.

I sent my report to the county in January. In it I described the gradients and the drainage and the cost of stone, as a surveyor should. I did not describe the snow, or the bothy, or the small brave stubbornness of a mule who knew the ground better than the man with the instruments. But I remember them, and I have written them down here, so that someone else might remember them too.""",
        ],
    },
]

_WEATHER = [
    "a thin grey rain",
    "a sharp east wind",
    "a bright cold sun",
    "a soft mist from the sea",
    "a long golden evening",
    "a sudden hailstorm",
    "a still and heavy heat",
    "the first frost",
]
_TIMES = [
    "at dawn",
    "in the early afternoon",
    "towards evening",
    "long after dark",
    "at first light",
    "before breakfast",
    "after supper",
    "on the following morning",
]
_SAYINGS = [
    "Slow work is still work",
    "There is always one more thing to mend",
    "Nobody ever drowned in a puddle they stepped round",
    "A good tool is half the job",
    "Weather changes, and so do people",
    "You cannot hurry the tide",
    "Write it down, or it did not happen",
    "Every road ends somewhere",
]
_ACTIONS = ["looked for", "cleaned", "carried", "examined", "put away", "mended", "found", "talked about"]
_FEELINGS = [
    "felt better than before",
    "could not stop smiling",
    "was too tired to speak",
    "began to understand",
    "said nothing for a while",
    "laughed out loud",
]


def _generated_paragraph(rng: random.Random, book: dict) -> str:
    """One paragraph assembled from small templates and the book's own people, places and things."""
    p, q = rng.sample(book["people"], 2)
    place, thing = rng.choice(book["places"]), rng.choice(book["things"])
    mood = rng.choice(book["moods"])
    sentences = [
        f"{rng.choice(_TIMES).capitalize()} there was {rng.choice(_WEATHER)}, and {p} went out to {place}.",
        f"It was a {mood} sort of day, and {p} {rng.choice(_ACTIONS)} {thing} without hurrying.",
        f"Later {q} came by and the two of them {rng.choice(_ACTIONS)} {rng.choice(book['things'])} together.",
        f'"{rng.choice(_SAYINGS)}," said {q}, and {p} {rng.choice(_FEELINGS)}.',
        f"By the time they reached {rng.choice(book['places'])} the light had changed, and {p} {rng.choice(_FEELINGS)}.",
    ]
    rng.shuffle(sentences[1:4])
    return " ".join(sentences[: rng.randint(3, 5)])


def _roman(n: int) -> str:
    return ["I", "II", "III", "IV", "V", "VI", "VII", "VIII", "IX", "X"][n - 1]


def book_body(book: dict, rng: random.Random) -> str:
    parts = []
    for i, chapter in enumerate(book["chapters"], start=1):
        paras = [textwrap.fill(p, 72) for p in chapter.split("\n\n")]
        paras += [textwrap.fill(_generated_paragraph(rng, book), 72) for _ in range(6)]
        parts.append(f"CHAPTER {_roman(i)}.\n\n" + "\n\n".join(paras))
    return "\n\n\n".join(parts)


def book_file(book: dict, rng: random.Random) -> bytes:
    title, variant = book["title"], book["variant"]
    upper = title.upper()
    header = [
        f"The Project Gutenberg eBook of {title}",
        "",
        "This file is a sample written for the nanoeuler project. It follows the layout",
        "of a Project Gutenberg plain-text ebook, but the story and the names are invented.",
        "",
    ]
    if "subtitle" in book:  # a long title wraps onto an indented second line
        header += [f"Title: {title}", f"       {book['subtitle']}", ""]
        upper = f"{title}, {book['subtitle']}".upper()
    else:
        header += [f"Title: {title}", ""]
    header += [
        f"Author: {book['author']}",
        "",
        f"Release date: January 1, 2024 [eBook #{book['id']}]",
        "",
        "Language: English",
        "",
        "",
    ]
    which = "THIS" if variant == "this-crlf" else "THE"
    gap = "" if variant == "nospace" else " "
    start = f"***{gap}START OF {which} PROJECT GUTENBERG EBOOK {upper}{gap}***"
    end = f"***{gap}END OF {which} PROJECT GUTENBERG EBOOK {upper}{gap}***"
    if variant == "bom-spaces":
        start, end = start + "   ", end + "  "
    footer = [
        "",
        "",
        "End matter: in a real Project Gutenberg file the license and the notes about",
        "the project follow here. The gutenberg stage drops everything after the END",
        "marker line.",
    ]
    lines = header + [start, "", "", book_body(book, rng), "", "", "", end] + footer
    text = "\n".join(lines) + "\n"
    if variant == "this-crlf":
        text = text.replace("\n", "\r\n")
    data = text.encode("utf-8")
    if variant == "bom-spaces":
        data = b"\xef\xbb\xbf" + data
    return data


# --------------------------------------------------------------------------------------------
# web articles (FineWeb-Edu layout)
# --------------------------------------------------------------------------------------------

TOPICS = [
    (
        "How Plants Make Their Food",
        "biology",
        [
            "Green plants make their own food through a process called photosynthesis.",
            "Inside the leaves are tiny structures called chloroplasts, which contain a green pigment named chlorophyll.",
            "Chlorophyll absorbs light, mostly red and blue light, and reflects green light, which is why leaves look green.",
            "The plant takes in carbon dioxide from the air through small openings on its leaves called stomata.",
            "Water travels up from the roots through thin tubes in the stem.",
            "Using the energy of light, the plant combines water and carbon dioxide into sugar and releases oxygen.",
            "The sugar is used for energy and to build new cells, and some of it is stored as starch.",
            "Almost every food chain on Earth begins with this process, so animals depend on plants even when they do not eat them directly.",
        ],
    ),
    (
        "The Water Cycle",
        "earth science",
        [
            "Water on Earth is always moving between the oceans, the air and the land.",
            "When the sun warms the surface of a lake or the sea, some of the water evaporates and becomes water vapour.",
            "As warm, moist air rises, it cools, and the vapour condenses into tiny droplets that form clouds.",
            "When the droplets join together and grow heavy enough, they fall as rain, snow, sleet or hail.",
            "Some of this water runs off into rivers, some soaks into the ground, and some is taken up by plants.",
            "Plants release water vapour from their leaves in a process called transpiration.",
            "Groundwater can stay underground for a few days or for thousands of years before it returns to the surface.",
            "The total amount of water on the planet stays almost the same; it simply changes form and place.",
        ],
    ),
    (
        "Understanding Fractions",
        "mathematics",
        [
            "A fraction describes a part of a whole.",
            "The number on the bottom, the denominator, tells you how many equal parts the whole is divided into.",
            "The number on the top, the numerator, tells you how many of those parts you have.",
            "For example, if a pizza is cut into eight equal slices and you eat three, you have eaten three eighths of the pizza.",
            "Two fractions are equivalent when they name the same amount, such as one half and two quarters.",
            "To add fractions with the same denominator, you add the numerators and keep the denominator.",
            "To add fractions with different denominators, you first rewrite them with a common denominator.",
            "Fractions, decimals and percentages are three ways of writing the same idea: one half is 0.5, which is 50 percent.",
        ],
    ),
    (
        "Why the Moon Has Phases",
        "astronomy",
        [
            "The Moon does not make its own light; it reflects light from the Sun.",
            "At any moment, half of the Moon is lit by the Sun and half is in darkness.",
            "As the Moon travels around the Earth, we see different amounts of its sunlit half.",
            "When the Moon is between the Earth and the Sun, the lit side faces away from us, and we call this a new moon.",
            "About two weeks later, the Moon is on the far side of the Earth, and we see the whole lit face as a full moon.",
            "Between these, the Moon appears as a crescent, then a half, then a gibbous shape.",
            "A complete cycle of phases takes about twenty-nine and a half days.",
            "The phases are not caused by the shadow of the Earth; that only happens during a lunar eclipse.",
        ],
    ),
    (
        "The Printing Press and the Spread of Ideas",
        "history",
        [
            "Before the printing press, books in Europe were copied by hand, which was slow and expensive.",
            "In the middle of the fifteenth century, Johannes Gutenberg developed a press that used movable metal type.",
            "Each letter was cast as a separate piece of metal, so the same letters could be arranged again and again.",
            "A printer could now produce hundreds of copies of a page in the time a scribe needed to copy one.",
            "Books became cheaper, and more people had a reason to learn to read.",
            "Scientists could share their results more quickly, and mistakes in copying became less common.",
            "Pamphlets and newspapers spread news and arguments across whole countries.",
            "Many historians count the printing press among the inventions that changed the world the most.",
        ],
    ),
    (
        "How Vaccines Train the Immune System",
        "health",
        [
            "The immune system protects the body by recognising germs and fighting them.",
            "When a new germ enters the body, the immune system needs time to learn how to defeat it.",
            "A vaccine gives the immune system a safe preview of a germ, such as a weakened form or a harmless piece of it.",
            "The body responds by making antibodies and memory cells that remember what the germ looks like.",
            "If the real germ arrives later, the memory cells recognise it and the body can respond much faster.",
            "This is why a vaccinated person often does not become ill, or becomes less ill.",
            "When many people in a community are protected, a disease has fewer chances to spread.",
            "Scientists test vaccines carefully in several stages before they are approved for use.",
        ],
    ),
    (
        "Simple Machines",
        "physics",
        [
            "A simple machine is a device that changes the size or direction of a force.",
            "The six classic simple machines are the lever, the wheel and axle, the pulley, the inclined plane, the wedge and the screw.",
            "A lever is a bar that turns around a fixed point called the fulcrum.",
            "By pushing on the long end of a lever, you can lift a heavy load on the short end with less force.",
            "An inclined plane, such as a ramp, lets you raise a load by pushing it a longer distance with a smaller force.",
            "A screw is really an inclined plane wrapped around a cylinder.",
            "Simple machines do not reduce the total work needed; they trade a smaller force for a longer distance.",
            "Most complicated machines, from bicycles to cranes, are built from combinations of simple machines.",
        ],
    ),
    (
        "Reading a Map",
        "geography",
        [
            "A map is a drawing of a place seen from above, made smaller so that it fits on a page.",
            "The scale of a map tells you how distances on the map compare with distances on the ground.",
            "A legend, or key, explains what the symbols and colours on the map mean.",
            "Most maps are drawn with north at the top, and a compass rose shows the directions.",
            "Contour lines join points of the same height, so lines drawn close together show steep ground.",
            "Grid references let you describe the exact position of a place using numbers or letters.",
            "Different maps are made for different purposes, such as roads, weather, population or rocks.",
            "Learning to read a map is a useful skill for walking, cycling and understanding the news.",
        ],
    ),
    (
        "What Is Erosion?",
        "earth science",
        [
            "Erosion is the process by which rock and soil are worn away and carried to a new place.",
            "Running water is the most powerful cause of erosion on land.",
            "Rivers carve valleys over long periods by carrying sand and stones that scrape the river bed.",
            "Wind can blow away loose soil, especially in dry places without many plants.",
            "Glaciers are slow rivers of ice that grind and pluck rock as they move downhill.",
            "Waves erode coastlines and can form cliffs, caves and arches.",
            "Plant roots help to hold soil in place, which is why planting trees can reduce erosion.",
            "The material that is carried away is eventually dropped somewhere else, forming new land such as deltas and beaches.",
        ],
    ),
    (
        "The Basics of Saving Money",
        "personal finance",
        [
            "Saving money means keeping part of what you earn instead of spending all of it.",
            "A simple first step is to write down what you spend for a month, so you can see where the money goes.",
            "Many people find it helpful to save a fixed amount as soon as they are paid, before spending on anything else.",
            "An emergency fund is money set aside for unexpected costs, such as a broken appliance or a medical bill.",
            "Money kept in a savings account may earn interest, which is a small payment for letting the bank hold it.",
            "Compound interest means that you also earn interest on the interest you have already received.",
            "Small amounts saved regularly can grow into a large sum over many years.",
            "Setting a clear goal, such as buying a bicycle or paying for a course, makes saving easier to stick with.",
        ],
    ),
    (
        "How Bees Communicate",
        "biology",
        [
            "Honeybees live in large colonies and need to share information about where food can be found.",
            "A forager bee that discovers a good patch of flowers returns to the hive and performs a dance.",
            "In the waggle dance, the bee runs in a straight line while shaking its body, then loops back and repeats.",
            "The direction of the straight run tells the other bees the direction of the food compared with the Sun.",
            "The length of the waggle part tells them roughly how far away the food is.",
            "Other bees follow the dancer closely and learn the smell of the flowers from her body.",
            "This system lets a colony send many workers quickly to the richest sources of nectar.",
            "Scientists spent many years with glass-walled hives to work out what the dances mean.",
        ],
    ),
    (
        "Introduction to Electricity",
        "physics",
        [
            "Electricity is the flow of electric charge, usually carried by tiny particles called electrons.",
            "For electricity to flow, there must be a complete path called a circuit.",
            "A battery pushes charge around the circuit; this push is measured in volts.",
            "The amount of charge flowing each second is called the current and is measured in amperes.",
            "Materials such as copper let charge flow easily and are called conductors.",
            "Materials such as rubber and plastic resist the flow and are called insulators.",
            "A switch opens or closes the circuit, turning a lamp off or on.",
            "Electricity can be dangerous, so wires are covered with insulation and circuits are protected by fuses.",
        ],
    ),
]

_INTROS = [
    "This short {s} guide explains the idea in plain language.",
    "In this {s} lesson we look at the topic one step at a time.",
    "Students often ask about this part of {s}. Here is a clear overview.",
    "The following {s} notes are suitable for learners of all ages.",
]
_OUTROS = [
    "Try explaining this topic to a friend; teaching is one of the best ways to learn.",
    "Review questions: What is the main idea? Can you give an example of your own?",
    "To learn more, look for a library book on {s} or ask your teacher for an experiment to try.",
    "Key idea: small steps, repeated over time, can explain large changes in the world around us.",
]
_LOW_QUALITY = [
    "Best deals today!!! Click here for cheap shoes, cheap bags, cheap everything. Limited offer, buy now, "
    "free shipping on orders over 50. Sign up for our newsletter and never miss a sale again!!!",
    "Home | About | Contact | Login | Register | Cart (0) | Privacy | Terms | Sitemap | Follow us | "
    "Copyright all rights reserved | Cookie settings | Accept all cookies",
    "lol this thread is wild. anyway who else is waiting for the update. first!!! bump. same here. "
    "ok thanks bye. posted from my phone sorry for typos.",
]
_NOT_ENGLISH = [
    "Le cycle de l'eau decrit le mouvement continu de l'eau entre les oceans, l'atmosphere et les "
    "continents. La chaleur du soleil fait evaporer l'eau, qui forme ensuite des nuages.",
    "La fotosintesis es el proceso por el cual las plantas verdes producen su propio alimento usando la "
    "luz del sol, el agua y el dioxido de carbono del aire.",
]
_DUMPS = ["CC-MAIN-2023-14", "CC-MAIN-2023-23", "CC-MAIN-2023-40", "CC-MAIN-2023-50", "CC-MAIN-2024-10"]
_SITES = ["example.org", "example.com", "example.net"]


def _article(rng: random.Random, title: str, subject: str, facts: list[str]) -> str:
    chosen = rng.sample(facts, rng.randint(5, len(facts)))
    chosen.sort(key=facts.index)  # keep the explanation in its natural order
    split = rng.randint(2, len(chosen) - 2)
    body = [
        title,
        "",
        rng.choice(_INTROS).format(s=subject),
        "",
        " ".join(chosen[:split]),
        "",
        " ".join(chosen[split:]),
        "",
        rng.choice(_OUTROS).format(s=subject),
    ]
    return "\n".join(body)


def web_rows(rng: random.Random) -> list[dict]:
    texts = []  # (text, score, language_score)
    for round_ in range(5):
        for title, subject, facts in TOPICS:
            texts.append((_article(rng, title, subject, facts), rng.uniform(2.6, 4.4), rng.uniform(0.93, 0.99)))
    texts += [(t, rng.uniform(0.4, 1.8), rng.uniform(0.7, 0.95)) for t in _LOW_QUALITY]
    texts += [(t, rng.uniform(2.8, 3.6), rng.uniform(0.02, 0.3)) for t in _NOT_ENGLISH]
    rng.shuffle(texts)
    rows = []
    for i, (text, score, lang) in enumerate(texts):
        dump = rng.choice(_DUMPS)
        slug = "-".join(text.split("\n", 1)[0].lower().split()[:5]).strip(".,!?|")
        seg = rng.randint(1_680_000_000_000, 1_710_000_000_000)
        rows.append(
            {
                "text": text,
                "id": f"<urn:uuid:{uuid.UUID(int=rng.getrandbits(128), version=4)}>",
                "dump": dump,
                "url": f"https://{rng.choice(_SITES)}/learn/{slug or 'page'}-{i}",
                "date": f"{dump[8:12]}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T"
                f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z",
                "file_path": f"s3://commoncrawl/crawl-data/{dump}/segments/{seg}.{i % 97}/warc/"
                f"{dump}-{seg % 10**14:014d}-{i:05d}.warc.gz",
                "language": "en" if lang > 0.5 else ("fr" if text.startswith("Le ") else "es"),
                "language_score": round(lang, 4),
                "token_count": int(len(text.split()) * 1.3),
                "score": round(score, 4),
                "int_score": int(min(5, max(0, round(score)))),
            }
        )
    return rows


def write_web(path: Path, rng: random.Random) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("text", pa.string()),
            ("id", pa.string()),
            ("dump", pa.string()),
            ("url", pa.string()),
            ("date", pa.string()),
            ("file_path", pa.string()),
            ("language", pa.string()),
            ("language_score", pa.float64()),
            ("token_count", pa.int64()),
            ("score", pa.float64()),
            ("int_score", pa.int64()),
        ]
    )
    table = pa.Table.from_pylist(web_rows(rng), schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd", row_group_size=32)


# --------------------------------------------------------------------------------------------
# instruction data (Stanford Alpaca layout)
# --------------------------------------------------------------------------------------------

HANDWRITTEN = [
    (
        "Give three tips for staying focused while studying.",
        "",
        "1. Put your phone in another room so notifications cannot interrupt you.\n"
        "2. Work in short blocks of about twenty-five minutes with a five-minute break after each.\n"
        "3. Decide before you start exactly what you want to finish before the next break.",
    ),
    (
        "Explain why the sky is blue in one or two sentences.",
        "",
        "Sunlight is made of many colours, and the air scatters short blue wavelengths much more than long red ones. "
        "That scattered blue light reaches our eyes from every part of the sky.",
    ),
    (
        "Write a short, friendly reminder asking a neighbour to return a borrowed ladder.",
        "",
        "Hi! I hope the ladder was useful. Whenever you are finished with it, could you drop it back at my place? "
        "I need it for the gutters this weekend. Thanks so much!",
    ),
    (
        "Summarize the following text in one sentence.",
        "The town library will close for two weeks in March while workers replace the roof. During that time, "
        "books can be returned at the community centre, and the mobile library van will visit the market square every Saturday.",
        "The library closes for two weeks in March for roof repairs, but returns and a Saturday mobile library will continue.",
    ),
    (
        "Classify each animal as a mammal, bird or fish.",
        "salmon, eagle, dolphin, sparrow, cow",
        "Salmon: fish\nEagle: bird\nDolphin: mammal\nSparrow: bird\nCow: mammal",
    ),
    ("Suggest a name for a bakery that specialises in bread made with local grain.", "", "Field and Hearth Bakery"),
    (
        "Rewrite the sentence so that it is more formal.",
        "Hey, can you send me that report soon?",
        "Could you please send me the report at your earliest convenience?",
    ),
    (
        "What is the difference between weather and climate?",
        "",
        "Weather describes the conditions of the air at a particular place and time, such as today's rain or wind. "
        "Climate is the typical pattern of weather in a region measured over many years.",
    ),
    ("List the three states of matter with an example of each.", "", "Solid: ice\nLiquid: water\nGas: steam"),
    (
        "Write a haiku about autumn leaves.",
        "",
        "Red leaves drift and turn\nthe path is a quiet fire\nwind counts every one",
    ),
    (
        "Explain what a verb is to a young child.",
        "",
        "A verb is a doing word. It tells you what someone or something does, like run, jump, eat or sing.",
    ),
    (
        "Give an example of a renewable source of energy and explain why it is renewable.",
        "",
        "Wind power is renewable because the wind keeps blowing as the sun heats the air unevenly, "
        "so using it today does not use it up for tomorrow.",
    ),
    (
        "Turn the following list into a sentence.",
        "eggs, flour, milk, sugar",
        "To make the batter you will need eggs, flour, milk and sugar.",
    ),
    (
        "Correct the spelling mistakes in the sentence.",
        "I recieved the pakage on wensday.",
        "I received the package on Wednesday.",
    ),
    (
        "Describe a lighthouse in two sentences.",
        "",
        "A lighthouse is a tall tower built near a dangerous coast, with a bright lamp at the top. "
        "Its light warns ships about rocks and helps sailors find their way at night.",
    ),
    (
        "Why is it important to drink water during exercise?",
        "",
        "During exercise you lose water through sweat and breathing. Drinking water replaces it, "
        "which helps control your body temperature and keeps your muscles working well.",
    ),
    (
        "Write a one-sentence story about a clock.",
        "",
        "The old clock in the hall had stopped for years, until the night a small boy wound it and it began, very softly, to tick again.",
    ),
    (
        "Name two advantages of riding a bicycle to work.",
        "",
        "It is good exercise, and it costs much less than driving a car.",
    ),
    ("Convert the temperature to Fahrenheit.", "100 degrees Celsius", "100 degrees Celsius is 212 degrees Fahrenheit."),
    ("Give a synonym for the word 'happy'.", "", "Cheerful."),
    (
        "Explain what a budget is.",
        "",
        "A budget is a plan for how you will spend and save your money over a period of time, "
        "based on how much you expect to earn.",
    ),
    (
        "Answer the question using the text.",
        "Mara kept the light on the night of the storm, while her father was stuck in the village. What did Mara do?",
        "She kept the lighthouse lamp burning during the storm.",
    ),
    (
        "Write a polite way to decline an invitation to a party.",
        "",
        "Thank you so much for inviting me! Unfortunately I already have plans that evening, "
        "but I hope you have a wonderful time.",
    ),
    (
        "What does a surveyor do?",
        "",
        "A surveyor measures land: the distances, angles and heights of the ground, "
        "so that maps can be drawn and roads or buildings can be planned.",
    ),
]

ANTONYMS = [
    ("hot", "cold"),
    ("early", "late"),
    ("open", "closed"),
    ("full", "empty"),
    ("light", "dark"),
    ("strong", "weak"),
    ("quiet", "loud"),
    ("young", "old"),
    ("above", "below"),
    ("begin", "end"),
    ("brave", "afraid"),
    ("wide", "narrow"),
    ("rough", "smooth"),
    ("remember", "forget"),
    ("arrive", "leave"),
    ("cheap", "expensive"),
    ("deep", "shallow"),
    ("fast", "slow"),
]
PLURALS = [
    ("child", "children"),
    ("mouse", "mice"),
    ("box", "boxes"),
    ("city", "cities"),
    ("leaf", "leaves"),
    ("tooth", "teeth"),
    ("sheep", "sheep"),
    ("knife", "knives"),
    ("hero", "heroes"),
    ("woman", "women"),
    ("bus", "buses"),
    ("story", "stories"),
    ("goose", "geese"),
    ("wolf", "wolves"),
]
SENTENCES = [
    "The ferry leaves at noon.",
    "My sister plays the violin.",
    "Bees visit the orchard every spring.",
    "The river carries soil to the sea.",
    "We planted tomatoes in the garden.",
    "The clock in the tower struck eight.",
    "A small boat waited by the harbour wall.",
    "The students measured the length of the playground.",
]


def alpaca_records(rng: random.Random) -> list[dict]:
    recs = [{"instruction": i, "input": x, "output": o} for i, x, o in HANDWRITTEN]
    for _ in range(24):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice(["plus", "minus", "times"])
        val = {"plus": a + b, "minus": a - b, "times": a * b}[op]
        recs.append({"instruction": f"What is {a} {op} {b}?", "input": "", "output": f"{a} {op} {b} is {val}."})
    for _ in range(14):
        nums = rng.sample(range(1, 100), rng.randint(4, 7))
        recs.append(
            {
                "instruction": "Sort the numbers in ascending order.",
                "input": ", ".join(map(str, nums)),
                "output": ", ".join(map(str, sorted(nums))),
            }
        )
    for n in rng.sample(range(10, 1000), 14):
        recs.append(
            {
                "instruction": f"Is {n} an even or an odd number?",
                "input": "",
                "output": f"{n} is {'even' if n % 2 == 0 else 'odd'}.",
            }
        )
    for word, opposite in ANTONYMS:
        recs.append({"instruction": "Give the opposite of the word.", "input": word, "output": opposite})
    for word, plural in PLURALS:
        recs.append(
            {
                "instruction": f"What is the plural of '{word}'?",
                "input": "",
                "output": f"The plural of '{word}' is '{plural}'.",
            }
        )
    for s in SENTENCES:
        recs.append(
            {
                "instruction": "Count the words in the sentence.",
                "input": s,
                "output": f"The sentence has {len(s.split())} words.",
            }
        )
        recs.append({"instruction": "Rewrite the sentence in capital letters.", "input": s, "output": s.upper()})
    for word in rng.sample([w for pair in ANTONYMS for w in pair], 10):
        recs.append({"instruction": "Spell the word backwards.", "input": word, "output": word[::-1]})
    rng.shuffle(recs)
    # Things the cleaner removes: two exact repeats and one record with an empty output.
    recs.insert(40, dict(recs[3]))
    recs.insert(90, dict(recs[17]))
    recs.insert(60, {"instruction": "Describe the colour of the sea at night.", "input": "", "output": "  "})
    return recs


# --------------------------------------------------------------------------------------------
# HellaSwag-format items
# --------------------------------------------------------------------------------------------

# (activity, ctx_a, ctx_b, right ending, three wrong endings)
HELLASWAG = [
    (
        "Making tea",
        "A woman fills a kettle at the sink and sets it on the stove.",
        "she",
        "waits for the water to boil, then pours it over the tea leaves in a pot.",
        [
            "throws the kettle out of the window and starts to sing.",
            "paints the stove a bright shade of green.",
            "climbs onto the roof with a ladder made of spoons.",
        ],
    ),
    (
        "Washing a dog",
        "A man lifts a small dog into a tub of warm water.",
        "he",
        "rubs shampoo into its fur and rinses it with a cup of water.",
        [
            "reads the dog a letter about the price of bread.",
            "fills the tub with sand and walks away.",
            "puts the dog on a shelf next to the books.",
        ],
    ),
    (
        "Rowing",
        "Two people push a wooden boat from the beach into the lake.",
        "they",
        "climb in, take the oars and row away from the shore.",
        [
            "bury the boat in the sand and leave it there.",
            "start to eat the oars slowly.",
            "lift the lake and fold it into a box.",
        ],
    ),
    (
        "Baking bread",
        "A baker mixes flour, water and yeast in a large bowl.",
        "the baker",
        "kneads the dough on the table and leaves it to rise under a cloth.",
        [
            "pours the dough into a shoe and ties the laces.",
            "sends the bowl to the post office.",
            "plants the flour in the garden and waters it.",
        ],
    ),
    (
        "Fixing a bicycle",
        "A boy turns his bicycle upside down on the grass.",
        "he",
        "takes off the flat tyre and patches the hole in the tube.",
        [
            "rides it upside down to school.",
            "asks the bicycle to fix itself.",
            "paints a face on the saddle and goes to sleep.",
        ],
    ),
    (
        "Playing chess",
        "Two old friends sit at a table in the park with a chess board between them.",
        "one of them",
        "moves a pawn forward two squares and waits for the other to reply.",
        [
            "eats the king and leaves the park.",
            "throws the board into the fountain and swims after it.",
            "draws a map of the moon on the table.",
        ],
    ),
    (
        "Gardening",
        "A girl kneels beside a row of small holes in the soil.",
        "she",
        "drops a seed into each hole and covers it gently with earth.",
        [
            "fills the holes with soup.",
            "shouts into each hole until it answers.",
            "carries the holes into the house one by one.",
        ],
    ),
    (
        "Ironing clothes",
        "A man lays a creased shirt flat on an ironing board.",
        "he",
        "presses the hot iron along the sleeves until the creases are gone.",
        [
            "folds the ironing board into a paper hat.",
            "puts the shirt in the oven for an hour.",
            "teaches the iron to read.",
        ],
    ),
    (
        "Painting a fence",
        "A woman opens a tin of white paint next to a wooden fence.",
        "she",
        "dips a brush in the paint and covers the boards with long even strokes.",
        [
            "drinks the paint and falls asleep.",
            "paints the grass instead and leaves.",
            "hides the fence under her bed.",
        ],
    ),
    (
        "Ice skating",
        "A child steps carefully onto the frozen pond in new skates.",
        "the child",
        "wobbles at first, then glides slowly across the ice with arms held out.",
        [
            "starts to dig a tunnel through the ice with a fork.",
            "sells the pond to a passing duck.",
            "sets the ice on fire to keep warm.",
        ],
    ),
    (
        "Cooking pasta",
        "A cook drops a handful of pasta into a pot of boiling water.",
        "",
        "After ten minutes the cook drains the pasta and stirs in the sauce.",
        [
            "After ten minutes the pasta climbs out of the pot and runs away.",
            "After ten minutes the cook freezes the water and skates on it.",
            "After ten minutes the cook mails the pot to a friend.",
        ],
    ),
    (
        "Building a snowman",
        "Three children roll a big ball of snow across the garden.",
        "they",
        "lift a smaller ball on top of it and give it a carrot for a nose.",
        [
            "pour hot tea over the snow to make it grow.",
            "put the snow in the cupboard for the summer.",
            "teach the snowball to bark.",
        ],
    ),
]


def hellaswag_items(rng: random.Random) -> list[dict]:
    items = []
    for i, (activity, ctx_a, ctx_b, right, wrong) in enumerate(HELLASWAG):
        endings = [right] + list(wrong)
        rng.shuffle(endings)
        items.append(
            {
                "ind": 100 + 7 * i,
                "activity_label": activity,
                "ctx_a": ctx_a,
                "ctx_b": ctx_b,
                "ctx": f"{ctx_a} {ctx_b}" if ctx_b else ctx_a,
                "split": "val",
                "split_type": "indomain" if i % 3 else "zeroshot",
                "label": endings.index(right),
                "endings": endings,
                "source_id": f"example~v_{i:04d}",
            }
        )
    return items


# preference pairs
# --------------------------------------------------------------------------------------------

_SHRUGS = ["I am not sure.", "Why do you want to know?", "Look it up yourself.", "That is a hard one, sorry."]


def preference_pairs(rng: random.Random) -> list[tuple[list[str], str, str]]:
    """(user/assistant turns ending with a user turn, chosen answer, rejected answer): the chosen answer
    is right and polite, the rejected one wrong or unhelpful."""
    pairs = []
    for word, plural in PLURALS:
        wrong = rng.choice([word + "s", word + "es", word])
        pairs.append(
            (
                [f"What is the plural of '{word}'?"],
                f"The plural of '{word}' is '{plural}'.",
                rng.choice([f"The plural of '{word}' is '{wrong}'.", rng.choice(_SHRUGS)]),
            )
        )
    for a, b in ANTONYMS:
        pairs.append(
            (
                [f"What is the opposite of '{a}'?"],
                f"The opposite of '{a}' is '{b}'.",
                rng.choice([f"The opposite of '{a}' is '{a}'.", rng.choice(_SHRUGS)]),
            )
        )
    for sentence in SENTENCES:
        n = len(sentence.split())
        pairs.append(
            (
                [f"How many words are in this sentence? {sentence}"],
                f"The sentence has {n} words.",
                f"The sentence has {n + rng.choice([-2, -1, 1, 3])} words.",
            )
        )
    for (word, plural), (a, b) in zip(PLURALS[:6], ANTONYMS):  # two-turn dialogues
        pairs.append(
            (
                ["Can you help me with some words?", "Of course. Which words?", f"What is the opposite of '{a}'?"],
                f"The opposite of '{a}' is '{b}'.",
                rng.choice(_SHRUGS),
            )
        )
    rng.shuffle(pairs)
    return pairs


def hh_lines(pairs, rng: random.Random) -> list[dict]:
    """HH-RLHF's layout: each side a whole transcript; plus one pair per thing the cleaner drops."""

    def transcript(turns, answer):
        roles = ["Human", "Assistant"] * len(turns)
        return "".join(f"\n\n{r}: {t}" for r, t in zip(roles, turns + [answer]))

    lines = [{"chosen": transcript(t, c), "rejected": transcript(t, r)} for t, c, r in pairs]
    t, c, _ = pairs[0]
    lines.insert(7, {"chosen": transcript(t, c), "rejected": transcript(t, c)})  # chosen == rejected
    lines.insert(19, {"chosen": transcript(t, c), "rejected": transcript(t, " ")})  # empty response
    lines.insert(
        23,
        {
            "chosen": transcript(["Hello."], "Hi!") + transcript(t, c),  # parted early
            "rejected": transcript(["Good day."], "Hi!") + transcript(t, c),
        },
    )
    lines.insert(31, dict(lines[4]))  # an exact repeat
    return lines


def ultrafeedback_rows(pairs) -> list[dict]:
    """UltraFeedback binarized's layout: chosen / rejected as message lists, the prompt repeated."""

    def messages(turns, answer):
        roles = ["user", "assistant"] * len(turns)
        return [{"content": t, "role": r} for r, t in zip(roles, turns + [answer])]

    rows = []
    for i, (t, c, r) in enumerate(pairs):
        rows.append(
            {
                "prompt": t[-1],
                "prompt_id": f"{i:064x}",
                "chosen": messages(t, c),
                "rejected": messages(t, r),
                "score_chosen": 8.0,
                "score_rejected": 3.0,
            }
        )
    t, c, _ = pairs[1]
    rows.insert(
        5,
        {
            "prompt": t[-1],
            "prompt_id": "f" * 64,
            "chosen": messages(t, c),
            "rejected": messages(t, c),
            "score_chosen": 5.0,
            "score_rejected": 5.0,
        },
    )  # chosen == rejected
    return rows


def write_prefs(out_dir: Path, rng: random.Random) -> None:
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    pairs = preference_pairs(rng)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in hh_lines(pairs, rng))
    (out_dir / "hh_train.jsonl.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
    pq.write_table(pa.Table.from_pylist(ultrafeedback_rows(pairs)), out_dir / "ultrafeedback_train_prefs.parquet")


def main() -> None:
    rng = random.Random(20240101)
    for book in BOOKS:
        path = OUT / "gutenberg" / f"pg{book['id']}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(book_file(book, rng))
    write_web(OUT / "fineweb" / "sample_000.parquet", rng)
    with open(OUT / "alpaca_data.json", "w", encoding="utf-8") as f:
        json.dump(alpaca_records(rng), f, indent=4, ensure_ascii=False)
        f.write("\n")
    with open(
        OUT / "hellaswag_val.jsonl", "w", encoding="utf-8"
    ) as f:  # its own seed: the files above stay as they were
        for item in hellaswag_items(random.Random(29)):
            f.write(json.dumps(item) + "\n")
    write_prefs(OUT / "prefs", random.Random(20261125))
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT} ({total:,} bytes)")


if __name__ == "__main__":
    main()
