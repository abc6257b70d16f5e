"""Supervised fine-tuning data: record formats, chat templating with answer-only loss masks, packing."""
