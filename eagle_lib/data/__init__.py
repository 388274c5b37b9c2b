"""Data wing: dataset adapters (formats), chat rendering + loss masks (chat), the row-mapping body 01 and 02 share
(records), the training sequences and their order (batches: 05's trainer, its hidden-state producers and 07's
subsets read them alike) and 07's subsets."""
