/* The avx2 tier's own layout of the K-quants for int8 activations (avx2/repack.c writes it at
 * load, avx2/quant_linear_int.c reads it), after llama.cpp's interleaved q4_K_8x8: the rows
 * in groups of 8, each group's super-blocks one after another, and in a super-block the 8
 * rows' factors side by side and their values interleaved, so that one load of weights holds
 * 8 rows, one activation load serves all of them, and a super-block's scaling is one vector
 * operation for the 8 rows (not one per row). The values are the stored integers (Q4_K 0..15,
 * Q5_K 0..31, Q6_K 0..63, its -32 taken as an offset); the bytes are the file's, but for the
 * 6-bit scales and mins of Q4_K/Q5_K, which take a byte each (148 and 180 bytes a row and
 * super-block where the file has 144 and 176; Q6_K keeps its 210).
 *
 * A group's super-block (8 times a row's bytes):
 * - Q4_K, Q5_K: d [8] and dmin [8] (fp16), sc [chunk][row] and mn [chunk][row] (bytes), the
 *   values (X8_QS), and Q5_K's fifth bits (X8_QH5);
 * - Q6_K: d [8] (fp16), sc [16ths][row] (int8), the low 4 bits (X8_QL6), the top 2 (X8_QH6).
 * The values of chunk j (32 of a row) come in 4 steps of 8: a step is 32 bytes, byte 8 slot
 * + v holding value 8 step + v of row X8_LO[slot] in its low nibble and of row X8_HI[slot] in
 * its high nibble (the slots make a super-block's sums come out in row order: the reader's
 * hadd). Q5_K's fifth bits: 8 bytes a step, bit 8 slot + v of the low rows' byte, bit 32 + 8
 * slot + v of the high rows'. Q6_K's top bits: 16 bytes a step, byte i holding in its bits 0-1
 * the low rows' byte i, in 2-3 their byte 16 + i, in 4-5 and 6-7 the high rows' bytes i and
 * 16 + i. A last group of fewer than 8 rows is padded with zero rows (they add nothing). */
#ifndef CONVEYOR_REPACKED_H
#define CONVEYOR_REPACKED_H

#include "blocks.h"

enum { X8 = 100 };  /* a repacked weight's type: X8 + its stored type */

static inline int is_repacked(int type) { return type >= X8; }

static inline int stored_type(int type) { return is_repacked(type) ? type - X8 : type; }

/* A row's bytes a super-block in the layout (a group's super-block is 8 of them); 0: a type
 * the layout does not take. */
static inline int x8_block_bytes(int type) {
    return type == Q4_K ? 148 : type == Q5_K ? 180 : type == Q6_K ? 210 : 0;
}

enum { X8_D = 0, X8_DMIN = 16, X8_SC = 32, X8_MN = 96, X8_QS = 160, X8_QH5 = 1184,
       X8_SC6 = 16, X8_QL6 = 144, X8_QH6 = 1168 };

static const int X8_LO[4] = {0, 1, 4, 5}, X8_HI[4] = {2, 3, 6, 7};

#endif
