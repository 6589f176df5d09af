"""Text tables as the commands print them (and segcli.api's results' str())."""


def table(rows):
    """Lines of text for rows of strings: left-aligned columns two spaces apart.

        table([("a", "bb"), ("ccc", "d")])  # ['a    bb', 'ccc  d']
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
