"""Numbers as people type them: a plain decimal in ASCII. Python's float takes more ('1_0'
is 10, and '١', an Arabic-Indic one, is 1), which a command line must not read as numbers.

    plain_number("2.5e-1")  # 0.25
"""


def plain_number(text):
    """`text` (surrounding blanks aside) as a float; ValueError unless it is a decimal number
    in ASCII without '_' (inf and nan included, as float spells them)."""
    stripped = text.strip()
    if not stripped.isascii() or "_" in stripped:
        raise ValueError(f"{text!r} is not a number")
    return float(stripped)
