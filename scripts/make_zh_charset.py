"""Write configs/charsets/zh_invoice.txt: a Chinese recognition charset of realistic size.

PP-OCRv3's Chinese dictionary holds 6623 characters; this one holds digits, capitals, the invoice
punctuation, the field keys of Chinese invoices and every third CJK Unified Ideograph
(U+4E00-U+9FA5), about 7000 characters: the head size the chain must carry. One per line.
"""
import string
from pathlib import Path

KEYS = "发票号码开票日期合计金额税率价数量单位名称"
chars = list(string.digits + string.ascii_uppercase + "-.,/:")
chars += [c for c in dict.fromkeys(KEYS) if c not in chars]
chars += [chr(cp) for cp in range(0x4E00, 0x9FA6, 3) if chr(cp) not in chars]
out = Path(__file__).resolve().parent.parent / "configs" / "charsets" / "zh_invoice.txt"
out.write_text("".join(c + "\n" for c in chars), encoding="utf-8")
print(f"{out}: {len(chars)} characters")
