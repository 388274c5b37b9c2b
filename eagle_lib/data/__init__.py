"""Data wing: dataset adapters (formats), chat rendering + loss masks (chat), the row-mapping body 01 and 02 share (records)."""
