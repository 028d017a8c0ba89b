/* _metadata_decode: a DCP ``.metadata`` pickle decoded straight into columns, at C speed.
 *
 * Why: torch writes ``.metadata`` as a pickle of its ``Metadata`` object graph. At a million tensors the
 * file is about 160 MB and unpickling it builds some 15 million Python objects (2 GB, 30 s through the
 * guarded unpickler). This module reads the same bytes and fills the arrays of
 * ``dcp_storage.formats.dcp_native.columns.MetadataColumns`` directly: no per-tensor Python object is
 * created except the state-dict key strings, and nothing from the file is ever called or imported (globals
 * are matched, by module and name, against a table built in Python from the allow-list).
 *
 * What it accepts: only the "regular, canonical" pickles torch's ``pickle.dump(Metadata)`` writes
 * (protocols 2 to 5): PROTO first; FRAME (well-formed); MEMOIZE or sequential BINPUT/LONG_BINPUT;
 * BINGET/LONG_BINGET of strings, globals, tuples, torch.Size, layouts, enum members and built instances;
 * EMPTY_DICT/EMPTY_LIST/EMPTY_TUPLE, MARK, TUPLE/TUPLE1-3, SETITEM(S), APPEND(S); NONE, NEWTRUE/NEWFALSE;
 * BININT1/BININT2/BININT/LONG1 integers in [0, 2**63-1]; SHORT_BINUNICODE/BINUNICODE/BINUNICODE8 strings of
 * plain valid UTF-8; GLOBAL/STACK_GLOBAL of the table's names; NEWOBJ (empty arguments) of the DCP metadata
 * classes then one BUILD with exactly their fields; REDUCE of torch.Size (tuple of ints),
 * torch.serialization._get_layout (a layout name), _MEM_FORMAT_ENCODING (0, 1 or 2), builtins.getattr of
 * _MEM_FORMAT_ENCODING and a member name (how Python 3.11.0-3.11.4 pickle enum members) and the pathlib classes
 * (string parts). Anything else (another opcode, global or shape; a GET of a list, dict or unbuilt object;
 * duplicate keys; a chunk without exactly one storage entry; bytes after STOP) makes ``decode`` return
 * None and the caller takes the general path (guarded unpickler and checks), which names the problem.
 *
 * Safety: every read is bounds-checked, every size computation overflow-checked; a first pass validates
 * the opcode stream and finds which memo entries are ever fetched (only those are kept); the value stack,
 * MARK nesting and container nesting have fixed bounds, so no recursion goes deeper than MAX_DEPTH.
 * The GIL is held throughout (Python objects are created along the way).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_STACK 65536u   /* values on the unpickling stack (a SETITEMS batch of 1000 needs 2000) */
#define MAX_MARKS 64       /* nested MARKs */
#define MAX_DEPTH 32       /* nested containers (torch's graph needs 7) */
#define MAX_GENERIC 16     /* entries of a small dict (an object's state) */
#define MAX_IDS 0xFFFFFFF0u /* entries, chunks, files: ids are uint32 */

enum { OK = 0, REFUSE = 1, NOMEM = 2, PYERR = 3 };

/* ---- values ---------------------------------------------------------------------------------- */

enum { T_EMPTY = 0, T_NONE, T_BOOL, T_INT, T_STR, T_GLOBAL, T_LAYOUT, T_MEMFMT, T_OBJ };
enum { K_TUPLE = 1, K_LIST, K_DICT, K_SIZE, K_INST, K_PATH };
enum { DK_EMPTY = 0, DK_GENERIC, DK_SDM, DK_STORAGE, DK_PLANNER };

/* global kinds (the table passed from Python) */
enum {
    G_METADATA = 0, G_TSM, G_BSM, G_CSM, G_TP, G_MI, G_SI, G_SM, /* classes: NEWOBJ + BUILD */
    G_SIZE, G_GET_LAYOUT, G_MEMFMT, G_DTYPE, G_LAYOUT, G_PATH, G_GETATTR, G_NKINDS
};

typedef struct Obj Obj;

typedef struct {
    uint8_t tag;
    uint32_t len; /* T_STR: byte length */
    union {
        int64_t i;   /* T_BOOL, T_INT, T_GLOBAL (table row), T_LAYOUT (layout row), T_MEMFMT */
        size_t off;  /* T_STR: offset in the input */
        Obj *o;      /* T_OBJ */
    } u;
} Val;

struct Obj {
    size_t refcnt;
    uint8_t kind;
    uint8_t depth;
    uint8_t flag;  /* K_INST: built; K_DICT: DK_* */
    uint8_t cls;   /* K_INST: G_* class; K_PATH: unused */
    size_t n, cap; /* items (tuple/list), pairs (generic dict), dims (size), fields (inst) */
    int64_t aux;   /* K_INST G_TP: packed properties; K_PATH: table row */
    void *data;    /* Val[] (tuple, list, dict: 2 per pair, inst fields), int64_t[] (size), Obj* (path parts) */
    PyObject *py;  /* DK_PLANNER: the dict being built */
};

static void obj_decref(Obj *o);
static void obj_release(Obj *o);
static uint64_t fmix(uint64_t h);

static inline void vincref(Val v) {
    if (v.tag == T_OBJ) v.u.o->refcnt++;
}
static inline void vdecref(Val v) {
    if (v.tag == T_OBJ) obj_decref(v.u.o);
}
static inline int vdepth(Val v) {
    return v.tag == T_OBJ ? v.u.o->depth : 0;
}
static inline int is_obj(Val v, int kind) {
    return v.tag == T_OBJ && v.u.o->kind == kind;
}
static inline int is_inst(Val v, int cls) {
    return v.tag == T_OBJ && v.u.o->kind == K_INST && v.u.o->cls == cls && v.u.o->flag;
}

/* Depth is bounded by MAX_DEPTH, so this recursion is too. */
static void obj_decref(Obj *o) {
    if (--o->refcnt) return;
    size_t i;
    Val *items = (Val *)o->data;
    switch (o->kind) {
    case K_TUPLE:
    case K_LIST:
    case K_INST:
        if (items)
            for (i = 0; i < o->n; i++) vdecref(items[i]);
        break;
    case K_DICT:
        if (items)
            for (i = 0; i < 2 * o->n; i++) vdecref(items[i]);
        Py_XDECREF(o->py);
        break;
    case K_PATH:
        if (o->data) obj_decref((Obj *)o->data);
        o->data = NULL;
        break;
    default:
        break;
    }
    free(o->data);
    obj_release(o);
}

/* Records are made and dropped by the million: keep some for reuse (the GIL serialises decode calls). */
#define FREE_OBJS 4096
static Obj *free_objs[FREE_OBJS];
static size_t n_free_objs;

static void obj_release(Obj *o) {
    if (n_free_objs < FREE_OBJS)
        free_objs[n_free_objs++] = o;
    else
        free(o);
}
static void free_list_drain(void) {
    while (n_free_objs) free(free_objs[--n_free_objs]);
}

static Obj *obj_new(int kind) {
    Obj *o = n_free_objs ? free_objs[--n_free_objs] : (Obj *)malloc(sizeof(Obj));
    if (o) {
        memset(o, 0, sizeof(Obj));
        o->refcnt = 1;
        o->kind = (uint8_t)kind;
        o->depth = 1;
    }
    return o;
}

static inline Val vobj(Obj *o) {
    Val v;
    v.tag = T_OBJ;
    v.len = 0;
    v.u.o = o;
    return v;
}
static inline Val vsimple(int tag, int64_t i) {
    Val v;
    v.tag = (uint8_t)tag;
    v.len = 0;
    v.u.i = i;
    return v;
}

/* ---- growable arrays ------------------------------------------------------------------------- */

typedef struct {
    void *p;
    size_t n, cap;
} Vec;

static int vec_reserve(Vec *v, size_t elem, size_t extra) {
    if (extra <= v->cap - v->n) return OK;
    if (extra > SIZE_MAX - v->n) return NOMEM;
    size_t need = v->n + extra, cap = v->cap ? v->cap : 16;
    while (cap < need) {
        if (cap > SIZE_MAX / 2) return NOMEM;
        cap *= 2;
    }
    if (cap > SIZE_MAX / elem) return NOMEM;
    void *np = realloc(v->p, cap * elem);
    if (!np) return NOMEM;
    v->p = np;
    v->cap = cap;
    return OK;
}

#define VPUSH(v, T, x) (vec_reserve(&(v), sizeof(T), 1) ? NOMEM : (((T *)(v).p)[(v).n++] = (T)(x), OK))
#define VAT(v, T) ((T *)(v).p)
#define TRY(e)                        \
    do {                              \
        int r_ = (e);                 \
        if (r_) return r_;            \
    } while (0)

/* ---- hashing and open-addressing tables of uint32 ids --------------------------------------- */

static uint64_t fmix(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}
static inline uint64_t hmix(uint64_t h, uint64_t x) {
    return (h ^ fmix(x + 0x9e3779b97f4a7c15ULL)) * 0x100000001b3ULL;
}
static uint64_t hash_bytes(const unsigned char *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ULL ^ n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0x100000001b3ULL;
        h ^= h >> 29;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, n);
    return fmix(h ^ w);
}

#define EMPTY_ID 0xFFFFFFFFu
#define EMPTY_SLOT UINT64_MAX
/* Slots hold (hash >> 32) << 32 | id: probing compares hashes first; growing never re-reads keys. */
typedef struct {
    uint64_t *s;
    size_t cap, n;
} Tab;

struct D;
typedef int (*EqFn)(const struct D *d, uint32_t id, const void *key);

static int tab_grow(Tab *t) {
    size_t cap = t->cap ? t->cap * 2 : 64;
    if (cap > SIZE_MAX / sizeof(uint64_t) || cap < t->cap) return NOMEM;
    uint64_t *s = (uint64_t *)malloc(cap * sizeof(uint64_t));
    if (!s) return NOMEM;
    memset(s, 0xFF, cap * sizeof(uint64_t));
    for (size_t i = 0; i < t->cap; i++) {
        uint64_t e = t->s[i];
        if (e == EMPTY_SLOT) continue;
        size_t j = (size_t)fmix(e >> 32) & (cap - 1);
        while (s[j] != EMPTY_SLOT) j = (j + 1) & (cap - 1);
        s[j] = e;
    }
    free(t->s);
    t->s = s;
    t->cap = cap;
    return OK;
}

/* The hash is not keyed and each step of it can be undone: a file can hold any number of keys of one hash,
 * and every insertion would probe all the earlier ones (quadratic: hours for a large file). At most half
 * full, an honest table's probe runs are a few slots; a run this long is refused (the general path's dicts
 * use Python's keyed hash). */
#define MAX_PROBE 256

/* The id equal to key, or (add) new_id inserted; EMPTY_ID when absent and not added. */
static int tab_find(const struct D *d, Tab *t, uint64_t h, const void *key, EqFn eq, int add, uint32_t new_id,
                    uint32_t *out) {
    if (add && (t->n + 1) * 2 > t->cap) TRY(tab_grow(t));
    *out = EMPTY_ID;
    if (!t->cap) return OK;
    uint64_t hi = h >> 32;
    size_t mask = t->cap - 1, i = (size_t)fmix(hi) & mask, probes = 0;
    while (t->s[i] != EMPTY_SLOT) {
        if ((t->s[i] >> 32) == hi && eq(d, (uint32_t)t->s[i], key)) {
            *out = (uint32_t)t->s[i];
            return OK;
        }
        if (++probes > MAX_PROBE) return REFUSE;
        i = (i + 1) & mask;
    }
    if (add) {
        t->s[i] = (hi << 32) | new_id;
        t->n++;
        *out = new_id;
    }
    return OK;
}

/* ---- the global table ------------------------------------------------------------------------ */

typedef struct {
    const char *mod, *name;
    Py_ssize_t modlen, namelen;
    int kind;
    PyObject *obj;
    long payload; /* G_LAYOUT: layout row */
} GEntry;

typedef struct {
    const char *name;
    Py_ssize_t len;
    PyObject *obj;
} LEntry;

/* ---- decoder state --------------------------------------------------------------------------- */

typedef struct D {
    const unsigned char *b;
    size_t len;
    GEntry *g;
    size_t ng;
    LEntry *lay;
    size_t nlay;
    LEntry *memfmt; /* _MEM_FORMAT_ENCODING's member names; a member's value is its row */
    size_t nmemfmt;
    /* stack and marks */
    Val *stack;
    size_t sp;
    size_t marks[MAX_MARKS];
    int nmarks;
    /* memo: only entries ever fetched are kept; slot = rank of the memo index among them */
    uint64_t *bits;
    uint32_t *rank;
    size_t nwords, memo_n, memo_next;
    Val *slots;
    /* columns */
    Vec name_off, name_len, is_bytes, prop, shape_at, dims, chunk_at, chunk_offsets, chunk_sizes, box_at;
    Vec file, byte_offset, byte_length, transform, chunk_entry;
    size_t filled;
    Tab names_tab, chunk_tab, file_tab, tr_tab, prop_tab;
    Vec file_off, file_len;        /* distinct relative paths, storage order */
    Vec tr_at, tr_off, tr_len;     /* distinct transform descriptor lists, storage order */
    Vec props;                     /* distinct packed TensorProperties */
    Obj *sdm, *storage, *metadata; /* references held */
} D;

static inline const unsigned char *sptr(const D *d, Val v) {
    return d->b + v.u.off;
}
static int str_eq_lit(const D *d, Val v, const char *lit) {
    size_t n = strlen(lit);
    return v.tag == T_STR && v.len == n && memcmp(sptr(d, v), lit, n) == 0;
}

/* ---- UTF-8 (strict: no surrogates, no overlong forms, nothing above U+10FFFF) ------------------ */

static int utf8_ok(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (!(w & 0x8080808080808080ULL)) {
                i += 8;
                continue;
            }
        }
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
        } else if (c >= 0xC2 && c <= 0xDF) {
            if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80) return 0;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (i + 2 >= n || (s[i + 1] & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80) return 0;
            if (c == 0xE0 && s[i + 1] < 0xA0) return 0; /* overlong */
            if (c == 0xED && s[i + 1] >= 0xA0) return 0; /* surrogate */
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (i + 3 >= n || (s[i + 1] & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 ||
                (s[i + 3] & 0xC0) != 0x80)
                return 0;
            if (c == 0xF0 && s[i + 1] < 0x90) return 0;
            if (c == 0xF4 && s[i + 1] >= 0x90) return 0;
            i += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

/* ---- little-endian reads ---------------------------------------------------------------------- */

static inline uint64_t rd_le(const unsigned char *p, int n) {
    uint64_t x = 0;
    for (int i = n - 1; i >= 0; i--) x = (x << 8) | p[i];
    return x;
}

static inline int popcount64(uint64_t x) {
    x = x - ((x >> 1) & 0x5555555555555555ULL);
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
    return (int)((x * 0x0101010101010101ULL) >> 56);
}

/* ---- pass 1: validate the opcode stream, find the memo entries ever fetched -------------------- */

static int mark_fetched(D *d, size_t idx) {
    size_t w = idx >> 6;
    if (w >= d->nwords) return REFUSE; /* cannot happen: idx < memo_n */
    d->bits[w] |= 1ULL << (idx & 63);
    return OK;
}

static int memo_grow(D *d) {
    /* one more memo entry: keep room for its bit */
    if (d->memo_n == SIZE_MAX) return NOMEM;
    d->memo_n++;
    size_t need = (d->memo_n + 63) >> 6;
    if (need > d->nwords) {
        size_t nw = d->nwords ? d->nwords * 2 : 64;
        if (nw > SIZE_MAX / sizeof(uint64_t)) return NOMEM;
        uint64_t *nb = (uint64_t *)realloc(d->bits, nw * sizeof(uint64_t));
        if (!nb) return NOMEM;
        memset(nb + d->nwords, 0, (nw - d->nwords) * sizeof(uint64_t));
        d->bits = nb;
        d->nwords = nw;
    }
    return OK;
}

static int scan(D *d) {
    const unsigned char *b = d->b;
    size_t n = d->len, pos = 2, frame_end = 0;
    int in_frame = 0;
    if (n < 2 || b[0] != 0x80 || b[1] < 2 || b[1] > 5) return REFUSE;
    for (;;) {
        if (in_frame && pos == frame_end) in_frame = 0;
        if (pos >= n) return REFUSE;
        unsigned op = b[pos++];
        size_t rem = n - pos, k;
        switch (op) {
        case 0x95: /* FRAME */
            if (in_frame || rem < 8) return REFUSE;
            k = (size_t)rd_le(b + pos, 8);
            if (rd_le(b + pos, 8) > (uint64_t)(rem - 8)) return REFUSE;
            pos += 8;
            frame_end = pos + k;
            in_frame = 1;
            continue;
        case '.': /* STOP */
            if (pos != n) return REFUSE;
            if (in_frame && pos != frame_end) return REFUSE;
            return OK;
        case '(': case '}': case ']': case ')': case 't': case 0x85: case 0x86: case 0x87: case 'N':
        case 0x88: case 0x89: case 0x93: case 0x81: case 'R': case 'b': case 's': case 'u': case 'a':
        case 'e':
            break;
        case 0x94: /* MEMOIZE */
            TRY(memo_grow(d));
            break;
        case 'K': /* BININT1 */
            if (rem < 1) return REFUSE;
            pos += 1;
            break;
        case 'M': /* BININT2 */
            if (rem < 2) return REFUSE;
            pos += 2;
            break;
        case 'J': /* BININT */
            if (rem < 4) return REFUSE;
            pos += 4;
            break;
        case 0x8a: /* LONG1 */
        case 0x8c: /* SHORT_BINUNICODE */
            if (rem < 1 || b[pos] > rem - 1) return REFUSE;
            pos += 1 + b[pos];
            break;
        case 'X': /* BINUNICODE */
            if (rem < 4 || rd_le(b + pos, 4) > (uint64_t)(rem - 4)) return REFUSE;
            pos += 4 + (size_t)rd_le(b + pos, 4);
            break;
        case 0x8d: /* BINUNICODE8 */
            if (rem < 8 || rd_le(b + pos, 8) > (uint64_t)(rem - 8)) return REFUSE;
            pos += 8 + (size_t)rd_le(b + pos, 8);
            break;
        case 'c': { /* GLOBAL: two lines */
            const unsigned char *e1 = (const unsigned char *)memchr(b + pos, '\n', rem);
            if (!e1) return REFUSE;
            size_t p2 = (size_t)(e1 - b) + 1;
            const unsigned char *e2 = (const unsigned char *)memchr(b + p2, '\n', n - p2);
            if (!e2) return REFUSE;
            pos = (size_t)(e2 - b) + 1;
            break;
        }
        case 'q': /* BINPUT */
        case 'r': /* LONG_BINPUT */
            k = op == 'q' ? 1 : 4;
            if (rem < k || rd_le(b + pos, (int)k) != (uint64_t)d->memo_n) return REFUSE; /* sequential only */
            pos += k;
            TRY(memo_grow(d));
            break;
        case 'h': /* BINGET */
        case 'j': /* LONG_BINGET */
            k = op == 'h' ? 1 : 4;
            if (rem < k || rd_le(b + pos, (int)k) >= (uint64_t)d->memo_n) return REFUSE;
            TRY(mark_fetched(d, (size_t)rd_le(b + pos, (int)k)));
            pos += k;
            break;
        default:
            return REFUSE;
        }
        if (in_frame && pos > frame_end) return REFUSE; /* an opcode straddling its frame's end */
    }
}

static int build_rank(D *d) {
    size_t total = 0;
    d->rank = (uint32_t *)malloc((d->nwords ? d->nwords : 1) * sizeof(uint32_t));
    if (!d->rank) return NOMEM;
    for (size_t w = 0; w < d->nwords; w++) {
        d->rank[w] = (uint32_t)total;
        total += (size_t)popcount64(d->bits[w]);
    }
    if (total > MAX_IDS) return REFUSE;
    d->slots = (Val *)calloc(total ? total : 1, sizeof(Val));
    return d->slots ? OK : NOMEM;
}

static inline int memo_slot(const D *d, size_t idx, size_t *slot) {
    size_t w = idx >> 6;
    if (w >= d->nwords) return 0;
    uint64_t bit = 1ULL << (idx & 63);
    if (!(d->bits[w] & bit)) return 0;
    *slot = d->rank[w] + (size_t)popcount64(d->bits[w] & (bit - 1));
    return 1;
}

/* ---- stack ----------------------------------------------------------------------------------- */

static inline size_t fence(const D *d) {
    return d->nmarks ? d->marks[d->nmarks - 1] : 0;
}
static int push(D *d, Val v) {
    if (d->sp >= MAX_STACK) {
        vdecref(v);
        return REFUSE;
    }
    d->stack[d->sp++] = v;
    return OK;
}
static int pop(D *d, Val *v) {
    if (d->sp <= fence(d)) return REFUSE;
    *v = d->stack[--d->sp];
    return OK;
}

/* ---- tables: names, chunks, files, transforms, properties ------------------------------------- */

typedef struct {
    const unsigned char *p;
    size_t n;
} SKey;

static int name_eq(const D *d, uint32_t id, const void *key) {
    const SKey *k = (const SKey *)key;
    return VAT(d->name_len, uint32_t)[id] == k->n && memcmp(d->b + VAT(d->name_off, size_t)[id], k->p, k->n) == 0;
}

typedef struct {
    const unsigned char *p;
    size_t n;
    int has_off;
    const int64_t *offs;
    size_t ndim;
} CKey;

static uint64_t chunk_key_hash(const unsigned char *p, size_t n, int has_off, const int64_t *offs, size_t ndim) {
    uint64_t h = hmix(hash_bytes(p, n), has_off ? 0x5eed + ndim : 0x7);
    for (size_t i = 0; i < ndim; i++) h = hmix(h, (uint64_t)offs[i]);
    return h;
}
static void chunk_key_of(const D *d, uint32_t c, CKey *k) {
    uint32_t e = VAT(d->chunk_entry, uint32_t)[c];
    int64_t lo = VAT(d->box_at, int64_t)[c], hi = VAT(d->box_at, int64_t)[c + 1];
    k->p = d->b + VAT(d->name_off, size_t)[e];
    k->n = VAT(d->name_len, uint32_t)[e];
    k->has_off = !VAT(d->is_bytes, uint8_t)[e];
    k->offs = VAT(d->chunk_offsets, int64_t) + lo;
    k->ndim = (size_t)(hi - lo);
}
static int chunk_eq(const D *d, uint32_t c, const void *key) {
    const CKey *q = (const CKey *)key;
    CKey k;
    chunk_key_of(d, c, &k);
    if (k.has_off != q->has_off || k.n != q->n || memcmp(k.p, q->p, k.n) != 0) return 0;
    if (!k.has_off) return 1;
    return k.ndim == q->ndim && (k.ndim == 0 || memcmp(k.offs, q->offs, k.ndim * sizeof(int64_t)) == 0);
}

static int file_eq(const D *d, uint32_t id, const void *key) {
    const SKey *k = (const SKey *)key;
    return VAT(d->file_len, uint32_t)[id] == k->n && memcmp(d->b + VAT(d->file_off, size_t)[id], k->p, k->n) == 0;
}

typedef struct {
    const Val *items;
    size_t n;
} TKey;

static uint64_t tr_hash_key(const D *d, const TKey *k) {
    uint64_t h = 0x1234 + k->n;
    for (size_t i = 0; i < k->n; i++) h = hmix(h, hash_bytes(sptr(d, k->items[i]), k->items[i].len));
    return h;
}
static int tr_eq(const D *d, uint32_t id, const void *key) {
    const TKey *k = (const TKey *)key;
    int64_t lo = VAT(d->tr_at, int64_t)[id], hi = VAT(d->tr_at, int64_t)[id + 1];
    if ((size_t)(hi - lo) != k->n) return 0;
    for (size_t i = 0; i < k->n; i++) {
        size_t off = VAT(d->tr_off, size_t)[lo + (int64_t)i];
        uint32_t len = VAT(d->tr_len, uint32_t)[lo + (int64_t)i];
        if (len != k->items[i].len || memcmp(d->b + off, sptr(d, k->items[i]), len) != 0) return 0;
    }
    return 1;
}

static int prop_eq(const D *d, uint32_t id, const void *key) {
    return VAT(d->props, int64_t)[id] == *(const int64_t *)key;
}

/* ---- state-dict entries (streamed into the columns) ------------------------------------------ */

/* Memo references repeat a built entry, or a shape, at a few bytes each: one tensor entry of k chunks under
 * n keys would make n * k chunks of columns from a file of k + n records. A file that is not such a bomb
 * has a storage entry of its own per chunk (a distinct MetadataIndex: >= 11 bytes) and spells out a shape
 * and chunk offsets per tensor (>= 2 bytes a dimension). Beyond these bounds the columns would outgrow the
 * input: refused, and the general path keeps the shared objects (and names what is wrong). */
#define BYTES_PER_CHUNK 8
static int within_input(const D *d, size_t chunks, size_t ndim) {
    size_t values = d->dims.n + d->chunk_offsets.n; /* <= d->len: checked before each addition */
    if (chunks && ndim > (d->len - values) / chunks) return 0;
    return ndim + chunks * ndim <= d->len - values;
}

static int push_chunk(D *d, uint32_t entry) {
    if (d->chunk_entry.n >= MAX_IDS || d->chunk_entry.n >= d->len / BYTES_PER_CHUNK) return REFUSE;
    TRY(VPUSH(d->chunk_entry, uint32_t, entry));
    TRY(VPUSH(d->box_at, int64_t, d->chunk_offsets.n));
    TRY(VPUSH(d->file, int32_t, -1));
    TRY(VPUSH(d->byte_offset, int64_t, 0));
    TRY(VPUSH(d->byte_length, int64_t, 0));
    TRY(VPUSH(d->transform, int32_t, -1));
    uint32_t c = (uint32_t)(d->chunk_entry.n - 1), got;
    CKey k;
    chunk_key_of(d, c, &k);
    TRY(tab_find(d, &d->chunk_tab, chunk_key_hash(k.p, k.n, k.has_off, k.offs, k.ndim), &k, chunk_eq, 1, c, &got));
    return got == c ? OK : REFUSE; /* two chunks of one tensor at one offset */
}

static int sdm_add(D *d, Val k, Val v) {
    if (k.tag != T_STR || !(is_inst(v, G_TSM) || is_inst(v, G_BSM))) return REFUSE;
    if (d->name_off.n >= MAX_IDS) return REFUSE;
    uint32_t entry = (uint32_t)d->name_off.n, got;
    TRY(VPUSH(d->name_off, size_t, k.u.off));
    TRY(VPUSH(d->name_len, uint32_t, k.len));
    SKey sk = {sptr(d, k), k.len};
    TRY(tab_find(d, &d->names_tab, hash_bytes(sk.p, sk.n), &sk, name_eq, 1, entry, &got));
    if (got != entry) return REFUSE; /* duplicate key */
    if (v.u.o->cls == G_BSM) {
        TRY(VPUSH(d->is_bytes, uint8_t, 1));
        TRY(VPUSH(d->prop, int32_t, -1));
        TRY(VPUSH(d->shape_at, int64_t, d->dims.n));
        TRY(push_chunk(d, entry));
        TRY(VPUSH(d->chunk_at, int64_t, d->chunk_entry.n));
        return OK;
    }
    Val *f = (Val *)v.u.o->data;
    Obj *props = f[0].u.o, *size = f[1].u.o, *chunks = f[2].u.o;
    if (!within_input(d, chunks->n, size->n)) return REFUSE;
    int64_t key = props->aux;
    if (d->props.n >= MAX_IDS) return REFUSE;
    TRY(tab_find(d, &d->prop_tab, fmix((uint64_t)key), &key, prop_eq, 1, (uint32_t)d->props.n, &got));
    if (got == d->props.n) TRY(VPUSH(d->props, int64_t, key));
    TRY(VPUSH(d->is_bytes, uint8_t, 0));
    TRY(VPUSH(d->prop, int32_t, got));
    size_t ndim = size->n;
    TRY(vec_reserve(&d->dims, sizeof(int64_t), ndim));
    if (ndim) memcpy(VAT(d->dims, int64_t) + d->dims.n, size->data, ndim * sizeof(int64_t));
    d->dims.n += ndim;
    TRY(VPUSH(d->shape_at, int64_t, d->dims.n));
    Val *items = (Val *)chunks->data;
    for (size_t i = 0; i < chunks->n; i++) {
        Val *cf = (Val *)items[i].u.o->data;
        Obj *offs = cf[0].u.o, *sizes = cf[1].u.o;
        if (offs->n != ndim || sizes->n != ndim) return REFUSE;
        TRY(vec_reserve(&d->chunk_offsets, sizeof(int64_t), ndim));
        TRY(vec_reserve(&d->chunk_sizes, sizeof(int64_t), ndim));
        if (ndim) {
            memcpy(VAT(d->chunk_offsets, int64_t) + d->chunk_offsets.n, offs->data, ndim * sizeof(int64_t));
            memcpy(VAT(d->chunk_sizes, int64_t) + d->chunk_sizes.n, sizes->data, ndim * sizeof(int64_t));
        }
        d->chunk_offsets.n += ndim;
        d->chunk_sizes.n += ndim;
        TRY(push_chunk(d, entry));
    }
    TRY(VPUSH(d->chunk_at, int64_t, d->chunk_entry.n));
    return OK;
}

/* A storage entry fills the chunk it serves (the state dict comes first in torch's files). */
static int storage_add(D *d, Val k, Val v) {
    if (!is_inst(k, G_MI) || !is_inst(v, G_SI)) return REFUSE;
    Val *mf = (Val *)k.u.o->data, *sf = (Val *)v.u.o->data;
    CKey ck;
    ck.p = sptr(d, mf[0]);
    ck.n = mf[0].len;
    ck.has_off = mf[1].tag == T_OBJ;
    ck.offs = ck.has_off ? (const int64_t *)mf[1].u.o->data : NULL;
    ck.ndim = ck.has_off ? mf[1].u.o->n : 0;
    uint32_t c, got;
    TRY(tab_find(d, &d->chunk_tab, chunk_key_hash(ck.p, ck.n, ck.has_off, ck.offs, ck.ndim), &ck, chunk_eq, 0, 0, &c));
    if (c == EMPTY_ID || VAT(d->file, int32_t)[c] != -1) return REFUSE; /* no such chunk, or served twice */
    /* relative_path: interned in storage order, renumbered in chunk order at the end */
    SKey sk = {sptr(d, sf[0]), sf[0].len};
    if (d->file_off.n >= MAX_IDS) return REFUSE;
    uint32_t fid = (uint32_t)d->file_off.n;
    TRY(tab_find(d, &d->file_tab, hash_bytes(sk.p, sk.n), &sk, file_eq, 1, fid, &got));
    if (got == fid) {
        TRY(VPUSH(d->file_off, size_t, sf[0].u.off));
        TRY(VPUSH(d->file_len, uint32_t, sf[0].len));
    }
    VAT(d->file, int32_t)[c] = (int32_t)got;
    if (sf[3].tag == T_OBJ) {
        Obj *l = sf[3].u.o;
        TKey tk = {(const Val *)l->data, l->n};
        size_t ntr = d->tr_at.n - 1;
        if (ntr >= MAX_IDS) return REFUSE;
        TRY(tab_find(d, &d->tr_tab, tr_hash_key(d, &tk), &tk, tr_eq, 1, (uint32_t)ntr, &got));
        if (got == ntr) {
            for (size_t i = 0; i < tk.n; i++) {
                TRY(VPUSH(d->tr_off, size_t, tk.items[i].u.off));
                TRY(VPUSH(d->tr_len, uint32_t, tk.items[i].len));
            }
            TRY(VPUSH(d->tr_at, int64_t, d->tr_off.n));
        }
        VAT(d->transform, int32_t)[c] = (int32_t)got;
    }
    VAT(d->byte_offset, int64_t)[c] = sf[1].u.i;
    VAT(d->byte_length, int64_t)[c] = sf[2].u.i;
    d->filled++;
    return OK;
}

static PyObject *str_to_py(const D *d, Val v) {
    return PyUnicode_DecodeUTF8((const char *)sptr(d, v), (Py_ssize_t)v.len, NULL);
}

/* A tuple or list of str and int (a planner_data value). */
static int plain_seq(Val v) {
    if (!(is_obj(v, K_TUPLE) || is_obj(v, K_LIST))) return 0;
    Val *it = (Val *)v.u.o->data;
    for (size_t i = 0; i < v.u.o->n; i++)
        if (it[i].tag != T_STR && it[i].tag != T_INT) return 0;
    return 1;
}

static PyObject *plain_to_py(const D *d, Val v) {
    Obj *o = v.u.o;
    int tuple = o->kind == K_TUPLE;
    PyObject *out = tuple ? PyTuple_New((Py_ssize_t)o->n) : PyList_New((Py_ssize_t)o->n);
    if (!out) return NULL;
    Val *it = (Val *)o->data;
    for (size_t i = 0; i < o->n; i++) {
        PyObject *x = it[i].tag == T_STR ? str_to_py(d, it[i]) : PyLong_FromLongLong(it[i].u.i);
        if (!x) {
            Py_DECREF(out);
            return NULL;
        }
        if (tuple)
            PyTuple_SET_ITEM(out, (Py_ssize_t)i, x);
        else
            PyList_SET_ITEM(out, (Py_ssize_t)i, x);
    }
    return out;
}

static int planner_add(D *d, Obj *dict, Val k, Val v) {
    if (k.tag != T_STR || !plain_seq(v)) return REFUSE;
    PyObject *pk = str_to_py(d, k);
    if (!pk) return PYERR;
    int has = PyDict_Contains(dict->py, pk);
    if (has) {
        Py_DECREF(pk);
        return has < 0 ? PYERR : REFUSE;
    }
    PyObject *pv = plain_to_py(d, v);
    if (!pv) {
        Py_DECREF(pk);
        return PYERR;
    }
    int r = PyDict_SetItem(dict->py, pk, pv);
    Py_DECREF(pk);
    Py_DECREF(pv);
    return r < 0 ? PYERR : OK;
}

/* A small dict with str keys (an object's state); takes k and v. */
static int generic_add(D *d, Obj *dict, Val k, Val v) {
    Val *p = (Val *)dict->data;
    int r = OK;
    if (k.tag != T_STR || dict->n >= MAX_GENERIC || vdepth(v) + 1 > MAX_DEPTH) r = REFUSE;
    for (size_t i = 0; !r && i < dict->n; i++)
        if (p[2 * i].len == k.len && memcmp(sptr(d, p[2 * i]), sptr(d, k), k.len) == 0) r = REFUSE;
    if (!r && !dict->data) {
        dict->data = malloc(2 * MAX_GENERIC * sizeof(Val));
        if (!dict->data) r = NOMEM;
        p = (Val *)dict->data;
    }
    if (r) {
        vdecref(k);
        vdecref(v);
        return r;
    }
    p[2 * dict->n] = k;
    p[2 * dict->n + 1] = v;
    dict->n++;
    if (vdepth(v) + 1 > dict->depth) dict->depth = (uint8_t)(vdepth(v) + 1);
    return OK;
}

/* dict[k] = v; takes k and v. The first entry decides what the dict is. */
static int dict_set(D *d, Obj *dict, Val k, Val v) {
    int r;
    if (dict->flag == DK_EMPTY) {
        if (k.tag == T_STR && (is_inst(v, G_TSM) || is_inst(v, G_BSM))) {
            if (d->sdm) r = REFUSE;
            else {
                d->sdm = dict;
                dict->refcnt++;
                dict->flag = DK_SDM;
                r = OK;
            }
        } else if (is_inst(k, G_MI) && is_inst(v, G_SI)) {
            if (d->storage) r = REFUSE;
            else {
                d->storage = dict;
                dict->refcnt++;
                dict->flag = DK_STORAGE;
                r = OK;
            }
        } else if (k.tag == T_STR && plain_seq(v)) {
            dict->py = PyDict_New();
            r = dict->py ? OK : PYERR;
            dict->flag = DK_PLANNER;
        } else {
            dict->flag = DK_GENERIC;
            r = OK;
        }
        if (r) {
            vdecref(k);
            vdecref(v);
            return r;
        }
    }
    switch (dict->flag) {
    case DK_SDM:
        r = sdm_add(d, k, v);
        break;
    case DK_STORAGE:
        r = storage_add(d, k, v);
        break;
    case DK_PLANNER:
        r = planner_add(d, dict, k, v);
        break;
    default:
        return generic_add(d, dict, k, v);
    }
    vdecref(k);
    vdecref(v);
    return r;
}

static int list_append(Obj *list, Val v) {
    if (vdepth(v) + 1 > MAX_DEPTH) {
        vdecref(v);
        return REFUSE;
    }
    Vec tmp = {list->data, list->n, list->cap};
    if (vec_reserve(&tmp, sizeof(Val), 1)) {
        vdecref(v);
        return NOMEM;
    }
    list->data = tmp.p;
    list->cap = tmp.cap;
    ((Val *)list->data)[list->n++] = v;
    if (vdepth(v) + 1 > list->depth) list->depth = (uint8_t)(vdepth(v) + 1);
    return OK;
}

/* ---- BUILD ----------------------------------------------------------------------------------- */

typedef struct {
    int nfields;
    const char *names[5];
    unsigned required;
} ClassInfo;

static const ClassInfo CLASSES[G_SM + 1] = {
    /* G_METADATA */ {5, {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}, 0x5},
    /* G_TSM */ {3, {"properties", "size", "chunks"}, 0x7},
    /* G_BSM */ {0, {NULL}, 0},
    /* G_CSM */ {2, {"offsets", "sizes"}, 0x3},
    /* G_TP */ {5, {NULL}, 0},
    /* G_MI */ {3, {"fqn", "offset", "index"}, 0x1},
    /* G_SI */ {4, {"relative_path", "offset", "length", "transform_descriptors"}, 0x7},
    /* G_SM */ {4, {"checkpoint_id", "save_id", "load_id", "modules"}, 0x0},
};

static int all_str(Val v) {
    if (!(is_obj(v, K_LIST) || is_obj(v, K_TUPLE))) return 0;
    Val *it = (Val *)v.u.o->data;
    for (size_t i = 0; i < v.u.o->n; i++)
        if (it[i].tag != T_STR) return 0;
    return 1;
}

static int none_or(Val v, int ok) {
    return v.tag == T_NONE || ok;
}

/* Is the empty-or-streamed dict v the one expected (want: the stream dict, or NULL when none was made)? */
static int stream_dict_ok(Val v, Obj *want) {
    if (!is_obj(v, K_DICT)) return 0;
    if (want) return v.u.o == want;
    return v.u.o->flag == DK_EMPTY;
}

static int check_fields(D *d, int cls, Val *f) {
    size_t i;
    switch (cls) {
    case G_METADATA:
        return stream_dict_ok(f[0], d->sdm) && stream_dict_ok(f[2], d->storage) &&
               none_or(f[1], is_obj(f[1], K_DICT) && (f[1].u.o->flag == DK_PLANNER || f[1].u.o->flag == DK_EMPTY)) &&
               none_or(f[3], is_inst(f[3], G_SM)) && none_or(f[4], f[4].tag == T_STR);
    case G_TSM:
        if (!is_inst(f[0], G_TP) || !is_obj(f[1], K_SIZE) || !is_obj(f[2], K_LIST)) return 0;
        for (i = 0; i < f[2].u.o->n; i++)
            if (!is_inst(((Val *)f[2].u.o->data)[i], G_CSM)) return 0;
        return 1;
    case G_CSM:
        return is_obj(f[0], K_SIZE) && is_obj(f[1], K_SIZE);
    case G_MI:
        return f[0].tag == T_STR && none_or(f[1], is_obj(f[1], K_SIZE)) && none_or(f[2], f[2].tag == T_INT);
    case G_SI:
        /* a list, as torch writes it (the columns serve lists: a tuple would come back unequal) */
        return f[0].tag == T_STR && f[1].tag == T_INT && f[2].tag == T_INT &&
               none_or(f[3], is_obj(f[3], K_LIST) && all_str(f[3]));
    case G_SM: /* absent fields stay T_EMPTY: pickle leaves them to the class (modules has no default) */
        return (f[0].tag == T_EMPTY || f[0].tag == T_NONE || f[0].tag == T_STR || is_obj(f[0], K_PATH)) &&
               (f[1].tag == T_EMPTY || f[1].tag == T_NONE || f[1].tag == T_STR) &&
               (f[2].tag == T_EMPTY || f[2].tag == T_NONE || f[2].tag == T_STR) &&
               (f[3].tag == T_EMPTY || (is_obj(f[3], K_LIST) && all_str(f[3])));
    default:
        return 0;
    }
}

/* TensorProperties.__setstate__((dtype, layout, requires_grad, _MEM_FORMAT_ENCODING(v), pin_memory)). */
static int build_tp(D *d, Obj *inst, Val state) {
    if (!is_obj(state, K_TUPLE) || state.u.o->n != 5) return REFUSE;
    Val *s = (Val *)state.u.o->data;
    if (s[0].tag != T_GLOBAL || d->g[s[0].u.i].kind != G_DTYPE) return REFUSE;
    int64_t layout;
    if (s[1].tag == T_LAYOUT)
        layout = s[1].u.i;
    else if (s[1].tag == T_GLOBAL && d->g[s[1].u.i].kind == G_LAYOUT)
        layout = d->g[s[1].u.i].payload;
    else
        return REFUSE;
    if (s[2].tag != T_BOOL || s[3].tag != T_MEMFMT || s[4].tag != T_BOOL) return REFUSE;
    inst->aux = (s[0].u.i << 24) | (layout << 8) | (s[2].u.i << 4) | (s[3].u.i << 1) | s[4].u.i;
    inst->flag = 1;
    return OK;
}

/* BUILD with a dict state on a dataclass instance (pickle updates its __dict__). Takes state. */
static int build(D *d, Obj *inst, Val state) {
    int r = REFUSE;
    if (inst->flag) goto out; /* built twice, or a BytesStorageMetadata */
    if (inst->cls == G_TP) {
        r = build_tp(d, inst, state);
        goto out;
    }
    if (!is_obj(state, K_DICT) || (state.u.o->flag != DK_EMPTY && state.u.o->flag != DK_GENERIC)) goto out;
    if (inst->cls == G_METADATA && d->metadata) goto out;
    const ClassInfo *ci = &CLASSES[inst->cls];
    Val f[5];
    unsigned seen = 0;
    int i, depth = 0;
    for (i = 0; i < 5; i++) f[i] = vsimple(i < ci->nfields && inst->cls != G_SM ? T_NONE : T_EMPTY, 0);
    Obj *so = state.u.o;
    Val *p = (Val *)so->data;
    for (size_t j = 0; j < so->n; j++) {
        for (i = 0; i < ci->nfields; i++)
            if (str_eq_lit(d, p[2 * j], ci->names[i])) break;
        if (i == ci->nfields) goto out; /* an unknown field */
        f[i] = p[2 * j + 1];
        seen |= 1u << i;
        if (vdepth(f[i]) > depth) depth = vdepth(f[i]);
    }
    if ((seen & ci->required) != ci->required || depth + 1 > MAX_DEPTH || !check_fields(d, inst->cls, f)) goto out;
    inst->data = malloc(5 * sizeof(Val));
    if (!inst->data) {
        r = NOMEM;
        goto out;
    }
    for (i = 0; i < 5; i++) vincref(f[i]);
    memcpy(inst->data, f, 5 * sizeof(Val));
    inst->n = 5;
    inst->depth = (uint8_t)(depth + 1);
    inst->flag = 1;
    if (inst->cls == G_METADATA) {
        d->metadata = inst;
        inst->refcnt++;
    }
    r = OK;
out:
    vdecref(state);
    return r;
}

/* ---- REDUCE, NEWOBJ, globals ----------------------------------------------------------------- */

static int reduce(D *d, Val fn, Val args, Val *out) {
    int r = REFUSE;
    if (fn.tag != T_GLOBAL || !is_obj(args, K_TUPLE)) goto done;
    Obj *a = args.u.o;
    Val *it = (Val *)a->data;
    switch (d->g[fn.u.i].kind) {
    case G_SIZE: {
        if (a->n != 1 || !is_obj(it[0], K_TUPLE)) goto done;
        Obj *t = it[0].u.o;
        Val *ti = (Val *)t->data;
        for (size_t i = 0; i < t->n; i++)
            if (ti[i].tag != T_INT) goto done;
        Obj *s = obj_new(K_SIZE);
        if (!s || !(s->data = malloc((t->n ? t->n : 1) * sizeof(int64_t)))) {
            if (s) obj_decref(s);
            r = NOMEM;
            goto done;
        }
        for (size_t i = 0; i < t->n; i++) ((int64_t *)s->data)[i] = ti[i].u.i;
        s->n = t->n;
        *out = vobj(s);
        r = OK;
        break;
    }
    case G_GET_LAYOUT:
        if (a->n != 1 || it[0].tag != T_STR) goto done;
        for (size_t i = 0; i < d->nlay; i++)
            if ((size_t)d->lay[i].len == it[0].len && memcmp(d->lay[i].name, sptr(d, it[0]), it[0].len) == 0) {
                *out = vsimple(T_LAYOUT, (int64_t)i);
                r = OK;
                break;
            }
        break;
    case G_MEMFMT:
        if (a->n != 1 || it[0].tag != T_INT || it[0].u.i > 2) goto done;
        *out = vsimple(T_MEMFMT, it[0].u.i);
        r = OK;
        break;
    case G_GETATTR: /* getattr(_MEM_FORMAT_ENCODING, member name): nothing else */
        if (a->n != 2 || it[0].tag != T_GLOBAL || d->g[it[0].u.i].kind != G_MEMFMT || it[1].tag != T_STR) goto done;
        for (size_t i = 0; i < d->nmemfmt; i++)
            if ((size_t)d->memfmt[i].len == it[1].len && memcmp(d->memfmt[i].name, sptr(d, it[1]), it[1].len) == 0) {
                *out = vsimple(T_MEMFMT, (int64_t)i);
                r = OK;
                break;
            }
        break;
    case G_PATH: {
        if (!all_str(args)) goto done;
        Obj *p = obj_new(K_PATH);
        if (!p) {
            r = NOMEM;
            goto done;
        }
        p->aux = fn.u.i;
        p->data = a;
        a->refcnt++;
        p->depth = (uint8_t)(a->depth + 1);
        *out = vobj(p);
        r = OK;
        break;
    }
    default:
        break;
    }
done:
    vdecref(args);
    return r;
}

static int newobj(D *d, Val cls, Val args, Val *out) {
    int r = REFUSE;
    if (cls.tag == T_GLOBAL && d->g[cls.u.i].kind <= G_SM && is_obj(args, K_TUPLE) && args.u.o->n == 0) {
        Obj *o = obj_new(K_INST);
        if (!o) {
            r = NOMEM;
        } else {
            o->cls = (uint8_t)d->g[cls.u.i].kind;
            o->flag = o->cls == G_BSM; /* no state: complete as made */
            *out = vobj(o);
            r = OK;
        }
    }
    vdecref(args);
    return r;
}

static int find_global(D *d, const unsigned char *mod, size_t modlen, const unsigned char *name, size_t namelen,
                       Val *out) {
    /* pickle maps Python 2's module names (__builtin__.getattr) only for protocols 0-2: as pickle.loads does */
    if (d->b[1] >= 3 && modlen == 11 && memcmp(mod, "__builtin__", 11) == 0) return REFUSE;
    for (size_t i = 0; i < d->ng; i++) {
        GEntry *e = &d->g[i];
        if ((size_t)e->modlen == modlen && (size_t)e->namelen == namelen && memcmp(e->mod, mod, modlen) == 0 &&
            memcmp(e->name, name, namelen) == 0) {
            *out = vsimple(T_GLOBAL, (int64_t)i);
            return OK;
        }
    }
    return REFUSE;
}

/* A tuple of the values stack[from:]; pushed in their place. */
static int make_tuple(D *d, size_t from) {
    size_t k = d->sp - from;
    int depth = 0;
    for (size_t i = from; i < d->sp; i++)
        if (vdepth(d->stack[i]) > depth) depth = vdepth(d->stack[i]);
    if (depth + 1 > MAX_DEPTH) return REFUSE;
    Obj *o = obj_new(K_TUPLE);
    if (!o) return NOMEM;
    o->data = malloc((k ? k : 1) * sizeof(Val));
    if (!o->data) {
        obj_release(o);
        return NOMEM;
    }
    if (k) memcpy(o->data, d->stack + from, k * sizeof(Val));
    o->n = k;
    o->depth = (uint8_t)(depth + 1);
    d->sp = from;
    return push(d, vobj(o));
}

/* ---- pass 2: run ----------------------------------------------------------------------------- */

static int run(D *d) {
    const unsigned char *b = d->b;
    size_t n = d->len, pos = 2;
    Val a, v, k;
    Obj *o;
    for (;;) {
        if (pos >= n) return REFUSE;
        unsigned op = b[pos++];
        size_t rem = n - pos, len, idx, slot;
        switch (op) {
        case 0x95: /* FRAME: checked by scan */
            if (rem < 8) return REFUSE;
            pos += 8;
            break;
        case '.': /* STOP */
            if (pos != n || d->sp != 1 || d->nmarks || !d->metadata) return REFUSE;
            v = d->stack[0];
            return v.tag == T_OBJ && v.u.o == d->metadata ? OK : REFUSE;
        case '(':
            if (d->nmarks >= MAX_MARKS) return REFUSE;
            d->marks[d->nmarks++] = d->sp;
            break;
        case 'N':
            TRY(push(d, vsimple(T_NONE, 0)));
            break;
        case 0x88:
        case 0x89:
            TRY(push(d, vsimple(T_BOOL, op == 0x88)));
            break;
        case 'K':
        case 'M':
        case 'J':
            len = op == 'K' ? 1 : op == 'M' ? 2 : 4;
            if (rem < len) return REFUSE;
            if (op == 'J' && (b[pos + 3] & 0x80)) return REFUSE; /* negative */
            TRY(push(d, vsimple(T_INT, (int64_t)rd_le(b + pos, (int)len))));
            pos += len;
            break;
        case 0x8a: /* LONG1 */
            if (rem < 1) return REFUSE;
            len = b[pos];
            if (len > 8 || len > rem - 1 || (len && (b[pos + len] & 0x80))) return REFUSE;
            TRY(push(d, vsimple(T_INT, len ? (int64_t)rd_le(b + pos + 1, (int)len) : 0)));
            pos += 1 + len;
            break;
        case 0x8c:
        case 'X':
        case 0x8d: {
            size_t w = op == 0x8c ? 1 : op == 'X' ? 4 : 8;
            if (rem < w || rd_le(b + pos, (int)w) > (uint64_t)(rem - w)) return REFUSE;
            len = (size_t)rd_le(b + pos, (int)w);
            pos += w;
            if (len > 0xFFFFFFFFu || !utf8_ok(b + pos, len)) return REFUSE;
            v.tag = T_STR;
            v.len = (uint32_t)len;
            v.u.off = pos;
            TRY(push(d, v));
            pos += len;
            break;
        }
        case 'c': { /* GLOBAL */
            const unsigned char *e1 = (const unsigned char *)memchr(b + pos, '\n', rem);
            if (!e1) return REFUSE;
            size_t p2 = (size_t)(e1 - b) + 1;
            const unsigned char *e2 = (const unsigned char *)memchr(b + p2, '\n', n - p2);
            if (!e2) return REFUSE;
            TRY(find_global(d, b + pos, (size_t)(e1 - (b + pos)), b + p2, (size_t)(e2 - (b + p2)), &v));
            TRY(push(d, v));
            pos = (size_t)(e2 - b) + 1;
            break;
        }
        case 0x93: /* STACK_GLOBAL */
            TRY(pop(d, &v));
            TRY(pop(d, &a));
            if (a.tag != T_STR || v.tag != T_STR) return REFUSE;
            TRY(find_global(d, sptr(d, a), a.len, sptr(d, v), v.len, &k));
            TRY(push(d, k));
            break;
        case '}':
        case ']':
        case ')':
            if (op == ')') {
                TRY(make_tuple(d, d->sp));
                break;
            }
            o = obj_new(op == '}' ? K_DICT : K_LIST);
            if (!o) return NOMEM;
            TRY(push(d, vobj(o)));
            break;
        case 't':
            if (!d->nmarks) return REFUSE;
            TRY(make_tuple(d, d->marks[--d->nmarks]));
            break;
        case 0x85:
        case 0x86:
        case 0x87:
            len = op - 0x84;
            if (d->sp < fence(d) + len) return REFUSE;
            TRY(make_tuple(d, d->sp - len));
            break;
        case 0x81: /* NEWOBJ */
            TRY(pop(d, &a));
            if (pop(d, &k)) {
                vdecref(a);
                return REFUSE;
            }
            TRY(newobj(d, k, a, &v));
            TRY(push(d, v));
            break;
        case 'R': /* REDUCE */
            TRY(pop(d, &a));
            if (pop(d, &k)) {
                vdecref(a);
                return REFUSE;
            }
            TRY(reduce(d, k, a, &v));
            TRY(push(d, v));
            break;
        case 'b': /* BUILD */
            TRY(pop(d, &a));
            if (d->sp <= fence(d) || !is_obj(d->stack[d->sp - 1], K_INST)) {
                vdecref(a);
                return REFUSE;
            }
            TRY(build(d, d->stack[d->sp - 1].u.o, a));
            break;
        case 's': /* SETITEM */
            TRY(pop(d, &v));
            if (pop(d, &k)) {
                vdecref(v);
                return REFUSE;
            }
            if (d->sp <= fence(d) || !is_obj(d->stack[d->sp - 1], K_DICT)) {
                vdecref(k);
                vdecref(v);
                return REFUSE;
            }
            TRY(dict_set(d, d->stack[d->sp - 1].u.o, k, v));
            break;
        case 'u': { /* SETITEMS */
            if (!d->nmarks) return REFUSE;
            size_t m = d->marks[--d->nmarks];
            if (m <= fence(d) || (d->sp - m) % 2 || !is_obj(d->stack[m - 1], K_DICT)) return REFUSE;
            o = d->stack[m - 1].u.o;
            size_t top = d->sp;
            d->sp = m;
            for (size_t i = m; i < top; i += 2) {
                int r = dict_set(d, o, d->stack[i], d->stack[i + 1]);
                if (r) {
                    for (size_t j = i + 2; j < top; j++) vdecref(d->stack[j]);
                    return r;
                }
            }
            break;
        }
        case 'a': /* APPEND */
            TRY(pop(d, &v));
            if (d->sp <= fence(d) || !is_obj(d->stack[d->sp - 1], K_LIST)) {
                vdecref(v);
                return REFUSE;
            }
            TRY(list_append(d->stack[d->sp - 1].u.o, v));
            break;
        case 'e': { /* APPENDS */
            if (!d->nmarks) return REFUSE;
            size_t m = d->marks[--d->nmarks];
            if (m <= fence(d) || !is_obj(d->stack[m - 1], K_LIST)) return REFUSE;
            o = d->stack[m - 1].u.o;
            size_t top = d->sp;
            d->sp = m;
            for (size_t i = m; i < top; i++) {
                int r = list_append(o, d->stack[i]);
                if (r) {
                    for (size_t j = i + 1; j < top; j++) vdecref(d->stack[j]);
                    return r;
                }
            }
            break;
        }
        case 0x94: /* MEMOIZE */
        case 'q':  /* BINPUT */
        case 'r':  /* LONG_BINPUT */
            len = op == 0x94 ? 0 : op == 'q' ? 1 : 4;
            if (rem < len || d->sp <= fence(d)) return REFUSE;
            pos += len;
            idx = d->memo_next++;
            if (memo_slot(d, idx, &slot)) {
                vdecref(d->slots[slot]);
                d->slots[slot] = d->stack[d->sp - 1];
                vincref(d->slots[slot]);
            }
            break;
        case 'h': /* BINGET */
        case 'j': /* LONG_BINGET */
            len = op == 'h' ? 1 : 4;
            if (rem < len) return REFUSE;
            idx = (size_t)rd_le(b + pos, (int)len);
            pos += len;
            if (idx >= d->memo_next || !memo_slot(d, idx, &slot)) return REFUSE;
            v = d->slots[slot];
            if (v.tag == T_EMPTY) return REFUSE;
            if (v.tag == T_OBJ) {
                o = v.u.o;
                if (o->kind == K_LIST || o->kind == K_DICT || (o->kind == K_INST && !o->flag)) return REFUSE;
            }
            vincref(v);
            TRY(push(d, v));
            break;
        default:
            return REFUSE;
        }
    }
}

/* ---- results --------------------------------------------------------------------------------- */

static PyObject *vec_bytes(Vec *v, size_t elem) {
    PyObject *out = PyBytes_FromStringAndSize((const char *)v->p, (Py_ssize_t)(v->n * elem));
    free(v->p);
    v->p = NULL;
    v->n = v->cap = 0;
    return out;
}

static PyObject *path_to_py(const D *d, Obj *p) {
    Obj *parts = (Obj *)p->data;
    PyObject *args = plain_to_py(d, vobj(parts));
    if (!args) return NULL;
    PyObject *out = PyObject_CallObject(d->g[p->aux].obj, args);
    Py_DECREF(args);
    return out;
}

static PyObject *sm_to_py(const D *d, Obj *sm) {
    static const char *const names[4] = {"checkpoint_id", "save_id", "load_id", "modules"};
    Val *f = (Val *)sm->data;
    PyObject *state = PyDict_New();
    if (!state) return NULL;
    for (int i = 0; i < 4; i++) {
        PyObject *x;
        if (f[i].tag == T_EMPTY) continue;
        if (f[i].tag == T_NONE)
            x = Py_NewRef(Py_None);
        else if (f[i].tag == T_STR)
            x = str_to_py(d, f[i]);
        else if (f[i].u.o->kind == K_PATH)
            x = path_to_py(d, f[i].u.o);
        else
            x = plain_to_py(d, f[i]);
        if (!x || PyDict_SetItemString(state, names[i], x) < 0) {
            Py_XDECREF(x);
            Py_DECREF(state);
            return NULL;
        }
        Py_DECREF(x);
    }
    return state;
}

static PyObject *str_list(const D *d, const size_t *offs, const uint32_t *lens, size_t n) {
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (!out) return NULL;
    for (size_t i = 0; i < n; i++) {
        PyObject *s = PyUnicode_DecodeUTF8((const char *)d->b + offs[i], (Py_ssize_t)lens[i], NULL);
        if (!s) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, s);
    }
    return out;
}

/* After STOP: every chunk served; files and transforms renumbered in chunk order; Python objects. */
static PyObject *finish(D *d, int *status) {
    size_t C = d->chunk_entry.n, i;
    *status = REFUSE;
    if (d->filled != C) return NULL;
    Val *mf = (Val *)d->metadata->data;
    size_t nfiles = d->file_off.n, ntr = d->tr_at.n - 1;
    int32_t *fmap = (int32_t *)malloc((nfiles ? nfiles : 1) * sizeof(int32_t));
    int32_t *tmap = (int32_t *)malloc((ntr ? ntr : 1) * sizeof(int32_t));
    size_t *forder_off = (size_t *)malloc((nfiles ? nfiles : 1) * sizeof(size_t));
    uint32_t *forder_len = (uint32_t *)malloc((nfiles ? nfiles : 1) * sizeof(uint32_t));
    uint32_t *torder = (uint32_t *)malloc((ntr ? ntr : 1) * sizeof(uint32_t));
    PyObject *names = NULL, *files = NULL, *transforms = NULL, *props = NULL, *planner = NULL, *sm = NULL,
             *version = NULL, *result = NULL;
    PyObject *arrays[14] = {NULL};
    size_t nf = 0, nt = 0;
    *status = NOMEM;
    if (!fmap || !tmap || !forder_off || !forder_len || !torder) goto out;
    for (i = 0; i < nfiles; i++) fmap[i] = -1;
    for (i = 0; i < ntr; i++) tmap[i] = -1;
    int32_t *file = VAT(d->file, int32_t), *tr = VAT(d->transform, int32_t);
    for (i = 0; i < C; i++) {
        int32_t f = file[i];
        if (fmap[f] < 0) {
            forder_off[nf] = VAT(d->file_off, size_t)[f];
            forder_len[nf] = VAT(d->file_len, uint32_t)[f];
            fmap[f] = (int32_t)nf++;
        }
        file[i] = fmap[f];
        if (tr[i] >= 0) {
            if (tmap[tr[i]] < 0) {
                torder[nt] = (uint32_t)tr[i];
                tmap[tr[i]] = (int32_t)nt++;
            }
            tr[i] = tmap[tr[i]];
        }
    }
    *status = PYERR;
    if (!(files = str_list(d, forder_off, forder_len, nf))) goto out;
    if (!(transforms = PyList_New((Py_ssize_t)nt))) goto out;
    for (i = 0; i < nt; i++) {
        int64_t lo = VAT(d->tr_at, int64_t)[torder[i]], hi = VAT(d->tr_at, int64_t)[torder[i] + 1];
        PyObject *l = str_list(d, VAT(d->tr_off, size_t) + lo, VAT(d->tr_len, uint32_t) + lo, (size_t)(hi - lo));
        PyObject *t = l ? PyList_AsTuple(l) : NULL;
        Py_XDECREF(l);
        if (!t) goto out;
        PyList_SET_ITEM(transforms, (Py_ssize_t)i, t);
    }
    if (!(props = PyList_New((Py_ssize_t)d->props.n))) goto out;
    for (i = 0; i < d->props.n; i++) {
        int64_t key = VAT(d->props, int64_t)[i];
        PyObject *t = Py_BuildValue("(OOOiO)", d->g[key >> 24].obj, d->lay[(key >> 8) & 0xFFFF].obj,
                                    (key >> 4) & 1 ? Py_True : Py_False, (int)((key >> 1) & 3),
                                    key & 1 ? Py_True : Py_False);
        if (!t) goto out;
        PyList_SET_ITEM(props, (Py_ssize_t)i, t);
    }
    if (mf[1].tag == T_NONE)
        planner = Py_NewRef(Py_None);
    else if (mf[1].u.o->py)
        planner = Py_NewRef(mf[1].u.o->py);
    else if (!(planner = PyDict_New()))
        goto out;
    if (mf[3].tag == T_NONE)
        sm = Py_NewRef(Py_None);
    else if (!(sm = sm_to_py(d, mf[3].u.o)))
        goto out;
    if (mf[4].tag == T_NONE)
        version = Py_NewRef(Py_None);
    else if (!(version = str_to_py(d, mf[4])))
        goto out;
    if (!(names = str_list(d, VAT(d->name_off, size_t), VAT(d->name_len, uint32_t), d->name_off.n))) goto out;
    free(d->name_off.p);
    d->name_off.p = NULL;
    Vec *vecs[14] = {&d->is_bytes, &d->prop, &d->shape_at, &d->dims, &d->chunk_at, &d->chunk_offsets,
                     &d->chunk_sizes, &d->box_at, &d->file, &d->byte_offset, &d->byte_length, &d->transform, NULL,
                     NULL};
    static const size_t sizes[12] = {1, 4, 8, 8, 8, 8, 8, 8, 4, 8, 8, 4};
    for (i = 0; i < 12; i++)
        if (!(arrays[i] = vec_bytes(vecs[i], sizes[i]))) goto out;
    result = Py_BuildValue("(NNNNNNNNNNNNNNNNNNN)", names, arrays[0], arrays[1], props, arrays[2], arrays[3],
                           arrays[4], arrays[5], arrays[6], arrays[7], arrays[8], arrays[9], arrays[10], arrays[11],
                           files, transforms, planner, sm, version);
    names = files = transforms = props = planner = sm = version = NULL;
    for (i = 0; i < 12; i++) arrays[i] = NULL;
    *status = result ? OK : PYERR;
out:
    free(fmap);
    free(tmap);
    free(forder_off);
    free(forder_len);
    free(torder);
    Py_XDECREF(names);
    Py_XDECREF(files);
    Py_XDECREF(transforms);
    Py_XDECREF(props);
    Py_XDECREF(planner);
    Py_XDECREF(sm);
    Py_XDECREF(version);
    for (i = 0; i < 12; i++) Py_XDECREF(arrays[i]);
    return result;
}

/* ---- set-up, tear-down, module --------------------------------------------------------------- */

static void teardown(D *d) {
    size_t i, nslots = 0;
    for (i = 0; i < d->sp; i++) vdecref(d->stack[i]);
    if (d->slots && d->rank) {
        for (i = 0; i < d->nwords; i++) nslots += (size_t)popcount64(d->bits[i]);
        for (i = 0; i < nslots; i++) vdecref(d->slots[i]);
    }
    if (d->sdm) obj_decref(d->sdm);
    if (d->storage) obj_decref(d->storage);
    if (d->metadata) obj_decref(d->metadata);
    free(d->stack);
    free(d->bits);
    free(d->rank);
    free(d->slots);
    Vec *vecs[] = {&d->name_off, &d->name_len, &d->is_bytes, &d->prop, &d->shape_at, &d->dims, &d->chunk_at,
                   &d->chunk_offsets, &d->chunk_sizes, &d->box_at, &d->file, &d->byte_offset, &d->byte_length,
                   &d->transform, &d->chunk_entry, &d->file_off, &d->file_len, &d->tr_at, &d->tr_off, &d->tr_len,
                   &d->props};
    for (i = 0; i < sizeof(vecs) / sizeof(vecs[0]); i++) free(vecs[i]->p);
    Tab *tabs[] = {&d->names_tab, &d->chunk_tab, &d->file_tab, &d->tr_tab, &d->prop_tab};
    for (i = 0; i < sizeof(tabs) / sizeof(tabs[0]); i++) free(tabs[i]->s);
    free(d->g);
    free(d->lay);
    free(d->memfmt);
}

static int load_tables(D *d, PyObject *table, PyObject *layouts, PyObject *memfmts) {
    if (!PyTuple_Check(table) || !PyTuple_Check(layouts) || !PyTuple_Check(memfmts)) {
        PyErr_SetString(PyExc_TypeError, "the tables must be tuples");
        return PYERR;
    }
    Py_ssize_t ng = PyTuple_GET_SIZE(table), nl = PyTuple_GET_SIZE(layouts), nm = PyTuple_GET_SIZE(memfmts), i;
    if (ng > 0xFFFF || nl > 0xFFFF || nm > 3) { /* T_MEMFMT holds 0, 1 or 2 (see TensorProperties) */
        PyErr_SetString(PyExc_ValueError, "table too long");
        return PYERR;
    }
    d->g = (GEntry *)calloc((size_t)ng + 1, sizeof(GEntry));
    d->lay = (LEntry *)calloc((size_t)nl + 1, sizeof(LEntry));
    d->memfmt = (LEntry *)calloc((size_t)nm + 1, sizeof(LEntry));
    if (!d->g || !d->lay || !d->memfmt) return NOMEM;
    for (i = 0; i < ng; i++) {
        GEntry *e = &d->g[i];
        PyObject *mod, *name, *obj;
        int kind;
        long payload;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(table, i), "UUiOl", &mod, &name, &kind, &obj, &payload))
            return PYERR;
        if (kind < 0 || kind >= G_NKINDS || payload < 0 || payload >= (nl ? nl : 1)) {
            PyErr_SetString(PyExc_ValueError, "bad global table row");
            return PYERR;
        }
        if (!(e->mod = PyUnicode_AsUTF8AndSize(mod, &e->modlen))) return PYERR;
        if (!(e->name = PyUnicode_AsUTF8AndSize(name, &e->namelen))) return PYERR;
        e->kind = kind;
        e->obj = obj;
        e->payload = payload;
    }
    for (i = 0; i < nl; i++) {
        PyObject *name, *obj;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(layouts, i), "UO", &name, &obj)) return PYERR;
        if (!(d->lay[i].name = PyUnicode_AsUTF8AndSize(name, &d->lay[i].len))) return PYERR;
        d->lay[i].obj = obj;
    }
    for (i = 0; i < nm; i++) {
        PyObject *name = PyTuple_GET_ITEM(memfmts, i);
        if (!PyUnicode_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "a memory format name must be a str");
            return PYERR;
        }
        if (!(d->memfmt[i].name = PyUnicode_AsUTF8AndSize(name, &d->memfmt[i].len))) return PYERR;
    }
    d->ng = (size_t)ng;
    d->nlay = (size_t)nl;
    d->nmemfmt = (size_t)nm;
    return OK;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *data, *table, *layouts, *memfmts, *result = NULL;
    Py_buffer view;
    D d;
    int r;
    if (!PyArg_ParseTuple(args, "OOOO:decode", &data, &table, &layouts, &memfmts)) return NULL;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) return NULL;
    memset(&d, 0, sizeof(d));
    d.b = (const unsigned char *)view.buf;
    d.len = (size_t)view.len;
    r = load_tables(&d, table, layouts, memfmts);
    if (r) { /* the caller's table, not the file */
        teardown(&d);
        PyBuffer_Release(&view);
        return r == NOMEM ? PyErr_NoMemory() : NULL;
    }
    r = scan(&d);
    if (!r) r = build_rank(&d);
    if (!r) r = (d.stack = (Val *)malloc(MAX_STACK * sizeof(Val))) ? OK : NOMEM;
    if (!r) r = VPUSH(d.shape_at, int64_t, 0);
    if (!r) r = VPUSH(d.chunk_at, int64_t, 0);
    if (!r) r = VPUSH(d.box_at, int64_t, 0);
    if (!r) r = VPUSH(d.tr_at, int64_t, 0);
    if (!r) r = run(&d);
    if (!r) result = finish(&d, &r);
    teardown(&d);
    free_list_drain();
    PyBuffer_Release(&view);
    if (r == OK) return result;
    if (r == NOMEM) return PyErr_NoMemory();
    if (r == PYERR) {
        /* a MemoryError propagates; anything else (a path class refusing its parts) means "not regular" */
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_MemoryError)) return NULL;
        PyErr_Clear();
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, table, layouts, memory_formats) -> tuple | None: the columns of a regular DCP .metadata "
     "pickle, else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_metadata_decode",
    "A DCP .metadata pickle decoded straight into columns (see _metadata_decode.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__metadata_decode(void) {
    return PyModule_Create(&module);
}
