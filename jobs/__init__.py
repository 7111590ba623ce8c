"""kvbatch job contract and client SDK."""
