__version__ = '0.1.0'


def parse_version_info(version_str):
    parts = []
    for piece in version_str.split('.'):
        parts.append(int(piece) if piece.isdigit() else piece)
    return tuple(parts)


version_info = parse_version_info(__version__)
