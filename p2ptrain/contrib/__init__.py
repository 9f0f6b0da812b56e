"""Contribution accounting: a receipt of every averaging round, signed by each member of its group,
and the leaderboard a majority of each group's signatures confirms.

    receipt.py      a round's receipt: built from what the group agreed on, signed, verified (sans-IO)
    leaderboard.py  which lines a majority of their group signed; per-peer figures (sans-IO)
    book.py         ContributionBook: sign each round's receipt, publish the newest in the DHT, keep a file
"""

from .book import ContributionBook, check_name, read_file, read_receipts, receipts_key
from .leaderboard import Row, leaderboard
from .receipt import Line, Receipt, Signed, build_receipt, parse_signed, sign

__all__ = ["ContributionBook", "Line", "Receipt", "Row", "Signed", "build_receipt", "check_name", "leaderboard",
           "parse_signed", "read_file", "read_receipts", "receipts_key", "sign"]
