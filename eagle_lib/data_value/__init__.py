"""Stage 07's wing (which data pays): subsets trained with 05's recipe, learning curves and their fits, the
multi-turn arms, tables and figures."""
