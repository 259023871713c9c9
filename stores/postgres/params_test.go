package postgres

import (
	"bytes"
	"testing"

	"github.com/jackc/pgx/v5/pgtype"
)

// A column encodes, in the binary format, to exactly the bytes that pgx
// gives the plain slice of the same values, NULLs included; and the
// registered codec is the one that encodes it. Catches a wrong array
// header (a flag, a lower bound, the element type) or element length,
// which the server would refuse or read as other values.
func TestColumnsEncodeAsPgxSlices(t *testing.T) {
	registered := pgtype.NewMap()
	registerColumns(registered)
	plain := pgtype.NewMap()
	for _, tc := range []struct {
		name   string
		oid    uint32
		column any
		slice  any
	}{
		{"bytea", pgtype.ByteaArrayOID, column[bytesParam]{[]byte("ab"), nil, {}, []byte("c")}, [][]byte{[]byte("ab"), nil, {}, []byte("c")}},
		{"bytea without NULL", pgtype.ByteaArrayOID, column[bytesParam]{[]byte("ab")}, [][]byte{[]byte("ab")}},
		{"text", pgtype.TextArrayOID, column[textParam]{"k", "", "é"}, []string{"k", "", "é"}},
		{"int8", pgtype.Int8ArrayOID, column[int8Param]{-1, 0, 1 << 40}, []int64{-1, 0, 1 << 40}},
		{"int4", pgtype.Int4ArrayOID, column[int4Param]{-1, 201}, []int32{-1, 201}},
		{"bool", pgtype.BoolArrayOID, column[boolParam]{true, false}, []bool{true, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, ok := registered.PlanEncode(tc.oid, pgtype.BinaryFormatCode, tc.column).(columnPlan); !ok {
				t.Fatalf("the column is not encoded by columnCodec")
			}
			got, err := registered.Encode(tc.oid, pgtype.BinaryFormatCode, tc.column, nil)
			if err != nil {
				t.Fatal(err)
			}
			want, err := plain.Encode(tc.oid, pgtype.BinaryFormatCode, tc.slice, nil)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("column %x\nslice  %x", got, want)
			}
			// The text format, which exec and simple_protocol send, is
			// pgx's own.
			gotText, err := registered.Encode(tc.oid, pgtype.TextFormatCode, tc.column, nil)
			if err != nil {
				t.Fatal(err)
			}
			wantText, err := plain.Encode(tc.oid, pgtype.TextFormatCode, tc.slice, nil)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(gotText, wantText) {
				t.Errorf("text: column %s, slice %s", gotText, wantText)
			}
		})
	}
}
