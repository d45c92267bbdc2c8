"""JSON Schema's string formats as regular expressions (Rust regex syntax, matched whole), written from the
RFCs that define them, so that constrained decoding writes only strings a validator accepts: the JSON form
turns `format` into a `pattern` (engine.grammar), the XML form matches raw text against it (engine.xmlcall).

Where an RFC allows a value that the usual validators reject (Python's datetime, jsonschema's checkers),
the regex is narrower than the RFC: year 0000 is left out (no datetime holds it) and so is the leap
second 60; February 29 comes only in leap years. A narrower regex costs the model nothing it needs, and a
value it writes always validates. The formats are the ones llguidance knows for JSON; any other is refused.
"""

from __future__ import annotations

# RFC 3339 §5.6 (date and time), with the calendar's month lengths
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001-9999
_MULTIPLE_OF_4 = "(?:0[48]|[2468][048]|[13579][26])"  # two digits
_LEAP_YEAR = f"(?:[0-9]{{2}}{_MULTIPLE_OF_4}|{_MULTIPLE_OF_4}00)"  # by 4, and a century only by 400
_MONTH_DAY = ("(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
              "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              "|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_FULL_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME_OFFSET = "(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_FULL_TIME = f"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?{_TIME_OFFSET}"

# RFC 3339 appendix A (ISO 8601 durations)
_DUR_SECOND = "[0-9]+S"
_DUR_MINUTE = f"[0-9]+M(?:{_DUR_SECOND})?"
_DUR_HOUR = f"[0-9]+H(?:{_DUR_MINUTE})?"
_DUR_TIME = f"T(?:{_DUR_HOUR}|{_DUR_MINUTE}|{_DUR_SECOND})"
_DUR_DAY = "[0-9]+D"
_DUR_MONTH = f"[0-9]+M(?:{_DUR_DAY})?"
_DUR_YEAR = f"[0-9]+Y(?:{_DUR_MONTH})?"
_DURATION = f"P(?:(?:{_DUR_DAY}|{_DUR_MONTH}|{_DUR_YEAR})(?:{_DUR_TIME})?|{_DUR_TIME}|[0-9]+W)"

# RFC 3986 §3.2.2 (dec-octet, IPv4address, IPv6address: RFC 4291 §2.2's text forms)
_DEC_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9][0-9]|[0-9])"
_IPV4 = f"(?:{_DEC_OCTET}\\.){{3}}{_DEC_OCTET}"
_H16 = "[0-9a-fA-F]{1,4}"
_LS32 = f"(?:{_H16}:{_H16}|{_IPV4})"


def _ipv6() -> str:
    """RFC 3986's IPv6address: eight 16-bit groups, or fewer with one run of zero groups written "::"."""
    # what follows the "::" when at most 0, 1, ..., 7 groups come before it
    tails = [f"(?:{_H16}:){{5}}{_LS32}", f"(?:{_H16}:){{4}}{_LS32}", f"(?:{_H16}:){{3}}{_LS32}",
             f"(?:{_H16}:){{2}}{_LS32}", f"{_H16}:{_LS32}", _LS32, _H16, ""]
    forms = [f"(?:{_H16}:){{6}}{_LS32}"]
    for before, tail in enumerate(tails):
        lead = f"(?:(?:{_H16}:){{0,{before - 1}}}{_H16})?" if before else ""
        forms.append(f"{lead}::{tail}")
    return "(?:" + "|".join(forms) + ")"


_IPV6 = _ipv6()

# RFC 5321 §4.1.2 (Mailbox: a Dot-string local part at a domain or an IPv4 address literal)
_ATOM = "[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]+"
_LET_DIG = "[a-zA-Z0-9]"
_SUB_DOMAIN = f"{_LET_DIG}(?:[a-zA-Z0-9-]*{_LET_DIG})?"
_EMAIL = f"{_ATOM}(?:\\.{_ATOM})*@(?:{_SUB_DOMAIN}(?:\\.{_SUB_DOMAIN})*|\\[{_IPV4}\\])"

# RFC 1123 §2.1 (a label of letters, digits and hyphens, 1-63 long, no hyphen at either end)
_LABEL = "[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
_HOSTNAME = f"{_LABEL}(?:\\.{_LABEL})*"

# RFC 4122 §3 (the string representation)
_UUID = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"

# RFC 3986 §3 (URI = scheme ":" hier-part [ "?" query ] [ "#" fragment ])
_UNRESERVED_SUB_DELIMS = "a-zA-Z0-9._~!$&'()*+,;=\\-"
_PCT = "%[0-9a-fA-F]{2}"
_PCHAR = f"(?:[{_UNRESERVED_SUB_DELIMS}:@]|{_PCT})"
_SEGMENT = f"{_PCHAR}*"
_SEGMENT_NZ = f"{_PCHAR}+"
_IP_LITERAL = f"\\[(?:{_IPV6}|v[0-9a-fA-F]+\\.[{_UNRESERVED_SUB_DELIMS}:]+)\\]"
_REG_NAME = f"(?:[{_UNRESERVED_SUB_DELIMS}]|{_PCT})*"
_AUTHORITY = (f"(?:(?:[{_UNRESERVED_SUB_DELIMS}:]|{_PCT})*@)?"
              f"(?:{_IP_LITERAL}|{_IPV4}|{_REG_NAME})(?::[0-9]*)?")
_HIER_PART = (f"(?://{_AUTHORITY}(?:/{_SEGMENT})*"
              f"|/(?:{_SEGMENT_NZ}(?:/{_SEGMENT})*)?"
              f"|{_SEGMENT_NZ}(?:/{_SEGMENT})*"
              "|)")
_QUERY = f"(?:{_PCHAR}|[/?])*"
_URI = f"[a-zA-Z][a-zA-Z0-9+.-]*:{_HIER_PART}(?:\\?{_QUERY})?(?:#{_QUERY})?"

FORMATS: dict[str, str] = {
    "date-time": f"{_FULL_DATE}[tT]{_FULL_TIME}",
    "date": _FULL_DATE,
    "time": _FULL_TIME,
    "duration": _DURATION,
    "email": _EMAIL,
    "hostname": _HOSTNAME,
    "ipv4": _IPV4,
    "ipv6": _IPV6,
    "uuid": _UUID,
    "uri": _URI,
}
# a format's bound on the whole string's length, which its regex does not carry (RFC 1123 §2.1: a host
# name of at most 253 characters)
MAX_LENGTH: dict[str, int] = {"hostname": 253}


def format_regex(name: str) -> str | None:
    """The regex a string of format `name` matches whole (None: a format we do not know)."""
    return FORMATS.get(name)
