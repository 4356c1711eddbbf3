"""Prompt sets for the MTP trainer's self-distillation data (`mtp_data.py`).

Training prompts are chat instructions (templates x topics) and raw-text
openings, shuffled with a fixed seed so that any prefix covers every template
and topic. The mix over `MORE_TOPICS` follows the one over `TOPICS`, so a run
with more prompts extends the data of a run with fewer instead of reshuffling it.
Held-out prompts share neither a topic nor a template with them: the trainer's
held-out accuracy estimates acceptance on prompts the head never saw. The
benchmarks' chat prompts are kept out of both (no near-duplicates).
"""

from __future__ import annotations

import itertools
import random

TOPICS = [
    "volcanoes", "photosynthesis", "the French Revolution", "machine learning", "coffee",
    "chess", "the moon", "bees", "bread baking", "electric cars", "the Roman Empire",
    "rainforests", "black holes", "gardening", "the human heart", "recycling",
    "ancient Egypt", "solar power", "dinosaurs", "the internet", "climate change",
    "mountains", "the ocean", "vaccines", "football", "painting", "trains", "friendship",
    "music theory", "earthquakes", "honey", "birds", "cities", "rivers",
    "programming in Python", "healthy breakfast", "winter", "time management", "robots",
    "the solar system", "tea", "whales", "museums", "airplanes", "the stock market", "pizza",
    "cats", "dogs", "yoga", "the brain", "electricity", "democracy", "the Olympic Games",
    "smartphones", "forests", "pirates", "the Great Wall of China", "chocolate", "astronauts",
    "volunteering", "photography", "knitting", "cryptography", "the water cycle", "castles",
    "hiking", "social media", "nutrition", "the Renaissance", "video games", "wind energy",
    "tigers", "public speaking", "the periodic table", "meditation", "bridges",
    "artificial intelligence", "rainbows", "spiders", "poetry", "the Amazon river",
    "first aid", "budgeting", "lightning", "penguins", "the violin", "mushrooms",
    "space telescopes", "origami", "tides", "the Industrial Revolution", "vitamins",
    "kangaroos", "elephants", "the immune system", "quantum computing", "3D printing",
    "sharks", "butterflies", "ants", "frogs", "horses", "wolves", "dolphins", "parrots",
    "the Arctic", "Antarctica", "the Himalayas", "the Nile", "Mars", "Jupiter", "the Sun",
    "gravity", "magnets", "sound waves", "atoms", "DNA", "evolution", "fossils",
    "weather forecasting", "hurricanes", "tornadoes", "snow", "clouds", "soil", "trees",
    "flowers", "cactus plants", "farming", "rice", "cheese", "soup", "spices",
    "vegetarian cooking", "fishing", "camping", "swimming", "running", "basketball",
    "tennis", "the guitar", "the piano", "opera", "movies", "theater", "comic books",
    "fairy tales", "Greek mythology", "Shakespeare", "novels", "writing a resume",
    "job interviews", "teamwork", "leadership", "saving money", "taxes", "banks",
    "inflation", "small businesses", "marketing", "online shopping", "cloud computing",
    "databases", "cybersecurity", "passwords", "open source software", "web design",
    "mobile apps", "remote work", "studying for exams", "learning math", "teachers",
    "grandparents", "pets", "moving to a new city", "public transport", "ships", "rockets",
    "satellites", "maps", "clocks", "calendars", "board games", "puzzles", "magic tricks",
    "zoos", "national parks", "islands", "waterfalls", "caves", "the Vikings",
    "the Silk Road", "the pyramids", "medieval knights", "windmills", "skyscrapers",
    "plastic pollution", "clean water", "bacteria", "the eye", "bones", "exercise",
    "happiness", "kindness", "habits", "curiosity", "birthdays", "holidays", "weddings",
]  # fmt: skip
# Appended after the first mix (never interleaved), so that a prefix of the list, and with
# it any saved generation data, stays the same when topics are added.
MORE_TOPICS = [
    "canoes", "coral reefs", "deserts", "sand dunes", "the printing press", "lemons",
    "submarines", "helicopters", "geysers", "icebergs", "jellyfish", "seahorses", "crabs",
    "lobsters", "starfish", "otters", "beavers", "squirrels", "hedgehogs", "peacocks", "bats",
    "camels", "giraffes", "zebras", "gorillas", "pandas", "polar bears", "eagles",
    "hummingbirds", "flamingos", "snails", "earthworms", "ladybugs", "dragonflies",
    "carrots", "salmon", "the Sahara", "the Alps", "the Andes", "the Mississippi River",
    "the Grand Canyon", "the Dead Sea", "Iceland", "Japan", "Australia", "Venice",
    "ancient Greece", "ancient China", "the Aztecs", "the Inca", "the Mayan calendar",
    "samurai", "the Cold War", "the space race", "the Titanic", "Stonehenge", "the Colosseum",
    "the Eiffel Tower", "the Statue of Liberty", "the telephone", "the radio", "television",
    "the light bulb", "steam engines", "the wheel", "paper", "glassblowing", "woodworking",
    "blacksmithing", "weaving", "sewing", "embroidery", "calligraphy", "sculpture", "jazz",
    "hip hop", "classical music", "drums", "the flute", "choirs", "ballet", "salsa dancing",
    "circuses", "puppets", "podcasts", "newspapers", "documentaries", "animation",
    "science fiction", "mystery novels", "folk tales", "Norse mythology", "superheroes",
    "bookshops", "postcards", "stamp collecting", "coins", "bonsai trees", "orchids",
    "sunflowers", "tulips", "herbs", "compost", "greenhouses", "irrigation", "vineyards",
    "olive oil", "pasta", "sushi", "tacos", "curry", "noodles", "dumplings", "ice cream",
    "apples", "bananas", "potatoes", "corn", "beans", "eggs", "yogurt", "fermentation",
    "barbecue", "street food", "picnics", "marbles", "posture", "stretching", "cycling",
    "skiing", "surfing", "rock climbing", "skateboarding", "martial arts", "baseball",
    "cricket", "golf", "volleyball", "table tennis", "sailing", "scuba diving",
    "bird watching", "stargazing", "microscopes", "the speed of light", "friction", "steam",
    "static electricity", "nuclear energy", "hydropower", "geothermal energy",
    "semiconductors", "operating systems", "search engines", "email", "video calls",
    "virtual reality", "drones", "self-driving cars", "blockchain", "computer viruses",
    "the keyboard", "smart homes", "smartwatches", "electric scooters", "highways",
    "traffic lights", "airports", "harbors", "fire stations", "hospitals", "nurses",
    "dentists", "pharmacies", "farmers markets", "supermarkets", "restaurants", "hotels",
    "tourism", "electronic waste", "air pollution", "deforestation", "endangered species",
    "wetlands", "grasslands", "the tundra", "monsoons", "droughts", "floods", "wildfires",
    "fog", "the northern lights", "eclipses", "meteor showers", "Saturn", "Venus",
    "the Milky Way", "asteroids", "the International Space Station", "gratitude", "patience",
    "honesty", "creativity", "boredom", "homesickness", "childhood", "siblings", "neighbors",
    "family dinners",
]  # fmt: skip
TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "Write a short story about {t}.",
    "List five interesting facts about {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Write a short poem about {t}.",
    "Give me a brief history of {t}.",
    "How would you describe {t} to someone who has never heard of it?",
    "Write an email to a friend about {t}.",
    "What are common misconceptions about {t}?",
    "Summarize the most important things to know about {t}.",
    "Why is {t} important?",
    "Write a dialogue between two friends talking about {t}.",
    "Give three tips for someone interested in {t}.",
    "Describe a typical day for someone who works with {t}.",
    "Explain how {t} works.",
    "What should a beginner know about {t}?",
    "Write a news report about {t}.",
    "Write the opening of a blog post about {t}.",
    "Write a haiku about {t}.",
    "What is the future of {t}?",
    "Explain {t} in simple terms.",
    "Write a letter to your future self about {t}.",
    "Create a short quiz with answers about {t}.",
    "What questions do people often ask about {t}?",
    "Write a persuasive paragraph about {t}.",
    "Describe {t} with five adjectives and explain each one.",
    "Write a children's bedtime story about {t}.",
    "What can we learn from {t}?",
    "Give me a step-by-step plan to learn about {t}.",
    "Write a speech for a class presentation on {t}.",
]
OPENINGS = [
    "The history of {t} begins",
    "Most people do not know that {t}",
    "In this article, we will look at {t} and",
    "Here is a simple guide to {t}:",
    "The subject of {t} is fascinating because",
    "Q: What is the most important thing to know about {t}?\nA:",
    "Chapter 1: An introduction to {t}\n\n",
    "Five reasons to care about {t}:\n1.",
]
CHAT_PER_RAW = 4  # chat instructions per raw-text opening in the training mix

# Held-out: neither these topics nor these templates occur above.
HELDOUT_TOPICS = [
    "owls", "autumn rain", "octopuses", "lanterns", "sourdough bread", "comets",
    "marathons", "typewriters", "kites", "fireflies", "canals", "sundials",
    "hot air balloons", "bamboo", "pottery", "tunnels",
]  # fmt: skip
HELDOUT_TEMPLATES = [
    "Tell me something surprising about {t}.",
    "Write a paragraph for a school textbook about {t}.",
    "How do {t} affect everyday life?",
    "Compare {t} with something similar and explain the differences.",
]


def training_prompts(limit: int) -> list[tuple[str, bool]]:
    """(text, is_chat) pairs: chat instructions and raw-text openings, mixed and shuffled;
    the mix over `TOPICS` first, then the one over `MORE_TOPICS`."""
    return (_mix(TOPICS, seed=0) + _mix(MORE_TOPICS, seed=1))[:limit]


def _mix(topics: list[str], seed: int) -> list[tuple[str, bool]]:
    rng = random.Random(seed)
    chat = [(tpl.format(t=t), True) for tpl, t in itertools.product(TEMPLATES, topics)]
    raw = [(o.format(t=t), False) for o, t in itertools.product(OPENINGS, topics)]
    rng.shuffle(chat)
    rng.shuffle(raw)
    groups = [chat[i : i + CHAT_PER_RAW] for i in range(0, len(chat), CHAT_PER_RAW)]
    return [
        p
        for group, opening in itertools.zip_longest(groups, raw)
        for p in (*(group or ()), opening)
        if p is not None
    ]


def heldout_prompts(limit: int) -> list[tuple[str, bool]]:
    pairs = [
        (tpl.format(t=t), True) for t, tpl in itertools.product(HELDOUT_TOPICS, HELDOUT_TEMPLATES)
    ]
    return pairs[:limit]


def prompt_ids(tok, text: str, chat: bool) -> list[int]:
    """A (text, is_chat) prompt as token ids: a user turn in the chat template, or raw text."""
    return (
        tok.apply_chat_template([{"role": "user", "content": text}]) if chat else tok.encode(text)
    )
