-- A subscription's filter evaluated so that it never fails the statement it is in: false
-- for any error its evaluation raises. `jsonb_path_match(..., silent => true)` hides
-- missing keys and type errors, not all: comparing a timestamp that has a zone with one
-- that has none (0A000), a body nested deep enough that `**` exhausts the stack (54001),
-- and the like failed the whole ingest statement, so the webhook was refused 500 and
-- reached no subscriber at all. The exception block costs a subtransaction a call, so
-- the ingest statements keep `jsonb_path_match` and use this only when their statement
-- failed so (`store::events::insert_with_fanout`), and the filter's try page always.
-- A new function only (expand): the release before it neither calls nor needs it.
CREATE OR REPLACE FUNCTION wg_filter_match(doc jsonb, filter jsonpath) RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
BEGIN
    RETURN jsonb_path_match(doc, filter, '{}', true) IS TRUE;
EXCEPTION WHEN OTHERS THEN
    RETURN false;
END
$$;
