/* One row of gs_topk_many's spec: SPEC int64 fields per tensor, by name. This file is the one layout both sides
 * read: select.c includes it, kernels/many.py reads the names and offsets from it (kernels.many.SPEC_FIELDS), so a
 * field moved or added here moves on both sides. Pointers travel as int64 addresses, floats as their bits. */
#define SP_X 0              /* float *: the tensor, accumulated in place (momentum correction: v); see SP_SRC */
#define SP_ADD 1            /* const float *: the gradient added to it in the pass (0: none) */
#define SP_N 2              /* its entries */
#define SP_K 3              /* the entries to select (0: a scan) */
#define SP_FLOOR 4          /* float bits: candidates are magnitudes at or above it */
#define SP_CAP 5            /* at most this many candidates kept */
#define SP_CAND_AT 6        /* the row's first slot in the candidate buffers */
#define SP_OUT_AT 7         /* the row's first slot in the output buffers */
#define SP_DRAWN 8          /* const int64 *: random-k's drawn positions (0: none) */
#define SP_DRAWN_N 9        /* how many were drawn (SP_DRAW_SEEDED: how many to draw) */
#define SP_SCORE_POS 10     /* const int64 *: REGTOP-k's positions sent last round (0: none) */
#define SP_SCORE_FAC 11     /* const float *: their factors */
#define SP_SCORE_N 12       /* how many */
#define SP_SCORE_BASE 13    /* float bits: the factor everywhere else */
#define SP_MOM_U 14         /* float *: momentum correction's u (0: none; then SP_ADD is required) */
#define SP_MOM_M 15         /* float bits: the momentum */
#define SP_MOM_NESTEROV 16  /* 1: Nesterov */
#define SP_SAMPLE_START 17  /* a strided sample copied out in the pass: first position */
#define SP_SAMPLE_STRIDE 18 /* its stride (<= 0: 1) */
#define SP_SAMPLE_N 19      /* its count (0: none) */
#define SP_SAMPLE_AT 20     /* the row's first slot in the sample buffer */
#define SP_LEV_AT 21        /* const double *: the magnitude levels whose moments the scan takes (scans) */
#define SP_LEV_N 22         /* how many levels */
#define SP_LEV_EXP 23       /* the levels' scale exponent */
#define SP_LEV_SQUARES 24   /* 1: second moments too */
#define SP_LEV_OUT 25       /* int64 *: the moments out (0: none) */
#define SP_SD_INTS 26       /* const int64 *: SIDCo's ints (its floor and levels from its state; 0: none) */
#define SP_SD_DOUBLES 27    /* const double *: SIDCo's doubles */
#define SP_SD_OUT 28        /* double *: SIDCo's out row, with the learned state */
#define SP_DGC_K 29         /* DGC's selection right after the scan: its target k (0: none) */
#define SP_DGC_FLAGS 30     /* bit 0 the floor is a guess, bit 1 zero the selection in x, bit 2 in u too, bit 3 bf16 */
#define SP_DGC_OUT 31       /* double *: DGC's 4 doubles out */
#define SP_SRC 32           /* const float *: read the tensor from here, x = src + add written whole (0: x itself) */
#define SP_WIRE_BF16 33     /* 1: the chosen go out in bf16 (out_bf16), x keeping v - bf16(v) (top-k rows, finite) */
#define SP_DRAW_SEEDED 34   /* 1: the candidates are SP_DRAWN_N positions drawn from SP_DRAW_SEED (random-k) */
#define SP_DRAW_SEED 35     /* that draw's seed, 63 bits */
#define SP_MOM_USRC 36      /* const float *: momentum correction's u read from here, u written whole (0: u itself) */
#define SP_KEEP_K 37        /* rTop-k: a random this many of the k chosen stay (0: all; seed SP_DRAW_SEED) */
#define SPEC 38             /* fields per row */
