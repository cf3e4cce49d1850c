"""python -m slimtune.config: the key table of docs/configuration.md."""

from slimtune.config import schema_markdown

if __name__ == "__main__":
    print(schema_markdown())
