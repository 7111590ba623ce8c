"""What a request's prompt may be, named once (torch-free: the job side and the worker's wire
name it too)."""

from __future__ import annotations

ChatMessages = list[dict[str, str]]  # [{"role": ..., "content": ...}], for the chat template
TextOrChat = str | ChatMessages  # what a job hands the engine
Prompt = TextOrChat | list[int]  # what the engine takes: token ids too
